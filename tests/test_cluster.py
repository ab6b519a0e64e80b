"""jaxdp.launch.detect_cluster: every launch convention from a fake environment, one process
per node and per GPU, and the partial / conflicting / malformed cases (errors that name the
variables)."""

import pytest

from jaxdp.launch import Cluster, ClusterError, detect_cluster
from jaxdp.launch._cluster import expand_nodelist


def test_nothing_set_is_not_a_cluster():
    assert detect_cluster({}) is None
    assert detect_cluster({"HOME": "/root", "NODE_RANK": "3"}) is None  # NODE_RANK alone: no


def test_cluster_is_a_named_tuple_exported_from_jaxdp_launch():
    import jaxdp.launch

    c = Cluster("h:1", 2, 0, None, "flags")
    assert c == ("h:1", 2, 0, None, "flags") and jaxdp.launch.Cluster is Cluster
    assert jaxdp.launch.detect_cluster is detect_cluster


# ---------------------------------------------------------------------- jax
def test_jax_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4"}
    env["JAX_PROCESS_ID"] = "3"
    assert detect_cluster(env) == Cluster("10.0.0.1:1234", 4, 3, None, "jax")
    env["JAX_LOCAL_DEVICE_IDS"] = "2,3"
    assert detect_cluster(env).local_device_ids == (2, 3)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, ["JAX_COORDINATOR_ADDRESS is not"]),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"},
            ["JAX_NUM_PROCESSES='2'", "JAX_PROCESS_ID is not", "Fix:"],
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            ["JAX_PROCESS_ID=2 with JAX_NUM_PROCESSES=2", "expected 0 <= JAX_PROCESS_ID"],
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            ["JAX_NUM_PROCESSES='two': expected an integer >= 1"],
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            ["JAX_COORDINATOR_ADDRESS='h': expected HOST:PORT"],
        ),
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_COORDINATOR_ADDRESS='h:1' is set but nothing"]),
    ],
)
def test_jax_partial_or_bad(env, words):
    with pytest.raises(ClusterError) as e:
        detect_cluster(env)
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------- MaxText
def test_maxtext_gpu_convention():
    env = {"JAX_COORDINATOR_IP": "10.1.0.7", "JAX_COORDINATOR_PORT": "9999"}
    env |= {"NNODES": "2", "NODE_RANK": "1"}
    assert detect_cluster(env) == Cluster("10.1.0.7:9999", 2, 1, None, "MaxText")
    del env["JAX_COORDINATOR_PORT"]
    assert detect_cluster(env).coordinator == "10.1.0.7:1234"  # the documented default
    del env["NODE_RANK"]
    with pytest.raises(ClusterError, match="NODE_RANK is not set"):
        detect_cluster(env)


# ---------------------------------------------------------------------- SkyPilot
def test_skypilot_first_ip_is_the_head():
    env = {
        "SKYPILOT_NODE_IPS": "10.2.0.4\n10.2.0.5\n10.2.0.6\n",
        "SKYPILOT_NODE_RANK": "2",
        "SKYPILOT_NUM_NODES": "3",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }
    assert detect_cluster(env) == Cluster("10.2.0.4:1234", 3, 2, None, "SkyPilot")
    assert detect_cluster(env | {"JAX_COORDINATOR_PORT": "5555"}).coordinator == "10.2.0.4:5555"
    with pytest.raises(ClusterError, match="SKYPILOT_NUM_NODES=4 but SKYPILOT_NODE_IPS lists 3"):
        detect_cluster(env | {"SKYPILOT_NUM_NODES": "4"})
    with pytest.raises(ClusterError, match="SKYPILOT_NODE_IPS is not set"):
        detect_cluster({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2"})


# ---------------------------------------------------------------------- Kubernetes
def test_kubernetes_indexed_job_and_jobset():
    env = {"JOB_COMPLETION_INDEX": "1", "JAX_NUM_PROCESSES": "2"}
    env["JAX_COORDINATOR_ADDRESS"] = "train-0.train:1234"
    # JAX_NUM_PROCESSES without JAX_PROCESS_ID: the Indexed Job's index is the process id
    assert detect_cluster(env) == Cluster("train-0.train:1234", 2, 1, None, "Kubernetes")
    jobset = {"JOB_COMPLETION_INDEX": "0", "PROCESSES_IN_JOB": "4", "JOBSET_NAME": "llm"}
    jobset |= {"REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0", "JAX_COORDINATOR_PORT": "3389"}
    assert detect_cluster(jobset) == Cluster("llm-workers-0-0.llm:3389", 4, 0, None, "Kubernetes")
    assert detect_cluster({"JOB_COMPLETION_INDEX": "5"}) is None  # independent one-process jobs


def test_kubernetes_partial():
    with pytest.raises(ClusterError, match="JAX_NUM_PROCESSES or PROCESSES_IN_JOB"):
        detect_cluster({"JOB_COMPLETION_INDEX": "0", "JOBSET_NAME": "llm"})
    with pytest.raises(ClusterError, match="not the coordinator: expected JAX_COORDINATOR_ADDRESS"):
        detect_cluster({"JOB_COMPLETION_INDEX": "0", "PROCESSES_IN_JOB": "2"})
    env = {"JOB_COMPLETION_INDEX": "0", "PROCESSES_IN_JOB": "2", "JOBSET_NAME": "a"}
    with pytest.raises(ClusterError, match="JOB_INDEX='1'"):
        detect_cluster(env | {"REPLICATED_JOB_NAME": "w", "JOB_INDEX": "1"})


# ---------------------------------------------------------------------- Open MPI
def test_open_mpi_per_gpu_and_per_node():
    env = {"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9"}
    env |= {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    env["JAX_COORDINATOR_ADDRESS"] = "n0:1234"
    assert detect_cluster(env) == Cluster("n0:1234", 16, 9, (1,), "Open MPI")
    per_node = env | {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    per_node |= {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert detect_cluster(per_node).local_device_ids is None
    # mpirun already bound one GPU to each rank: use it (not device LOCAL_RANK of one)
    assert detect_cluster(env | {"CUDA_VISIBLE_DEVICES": "1"}).local_device_ids is None
    del env["JAX_COORDINATOR_ADDRESS"]
    hnp = env | {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.9.8.7,172.17.0.1:4567"}
    assert detect_cluster(hnp).coordinator == "10.9.8.7:1234"
    with pytest.raises(ClusterError, match="JAX_COORDINATOR_ADDRESS, or Open MPI 4"):
        detect_cluster(env)


# ---------------------------------------------------------------------- SLURM
@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu-[1-3]-x", ["gpu-1-x", "gpu-2-x", "gpu-3-x"]),
        ("r[1-2]n[8-9],solo", ["r1n8", "r1n9", "r2n8", "r2n9", "solo"]),
        ("127.0.0.1", ["127.0.0.1"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def _slurm(**kv):
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2"}
    return env | {k: str(v) for k, v in kv.items()}


def test_slurm_one_process_per_gpu_and_per_node():
    port = 61440 + 4242 % 4096  # jax's rule
    per_gpu = _slurm(SLURM_NTASKS=16, SLURM_PROCID=11, SLURM_LOCALID=3, SLURM_NODEID=1)
    per_gpu["SLURM_TASKS_PER_NODE"] = "8(x2)"
    assert detect_cluster(per_gpu) == Cluster(f"node01:{port}", 16, 11, (3,), "SLURM")
    per_node = _slurm(SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=0, SLURM_NODEID=1)
    per_node["SLURM_TASKS_PER_NODE"] = "1(x2)"
    assert detect_cluster(per_node) == Cluster(f"node01:{port}", 2, 1, None, "SLURM")
    # without a tasks-per-node variable: tasks / nodes
    assert detect_cluster(_slurm(SLURM_NTASKS=2, SLURM_PROCID=0)).local_device_ids is None
    # srun --gpus-per-task: SLURM binds the GPUs itself
    bound = per_gpu | {"SLURM_GPUS_PER_TASK": "1"}
    assert detect_cluster(bound).local_device_ids is None
    # the step's own variables win over the job's; JAX_COORDINATOR_PORT over the derived port
    step = per_node | {"SLURM_STEP_NODELIST": "gpu-[3-4]-x", "JAX_COORDINATOR_PORT": "7777"}
    assert detect_cluster(step).coordinator == "gpu-3-x:7777"
    assert detect_cluster(_slurm(SLURM_NTASKS=1, SLURM_PROCID=0)) is None  # one task
    assert detect_cluster({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}) is None  # batch script


def test_slurm_partial_and_bad():
    env = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    with pytest.raises(ClusterError, match="SLURM_STEP_NODELIST, SLURM_JOB_NODELIST"):
        detect_cluster(env)
    with pytest.raises(ClusterError, match=r"SLURM_JOB_NODELIST='node\[01-02': unbalanced"):
        detect_cluster(env | {"SLURM_JOB_NODELIST": "node[01-02"})
    with pytest.raises(ClusterError, match="SLURM_PROCID=5 with SLURM_NTASKS=2"):
        detect_cluster(_slurm(SLURM_NTASKS=2, SLURM_PROCID=5))
    with pytest.raises(ClusterError, match="SLURM_LOCALID is not set"):
        detect_cluster(_slurm(SLURM_NTASKS=16, SLURM_PROCID=1, SLURM_TASKS_PER_NODE="8(x2)"))


# ---------------------------------------------------------------------- several at once
def test_conventions_that_agree_are_fine_and_the_first_wins():
    env = _slurm(SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=0)
    env |= {"JAX_COORDINATOR_ADDRESS": "head:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert detect_cluster(env).source == "jax"


def test_conventions_that_disagree_are_an_error_naming_both():
    env = _slurm(SLURM_NTASKS=4, SLURM_PROCID=1, SLURM_LOCALID=1)
    env |= {"JAX_COORDINATOR_ADDRESS": "head:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    with pytest.raises(ClusterError) as e:
        detect_cluster(env)
    msg = str(e.value)
    assert "jax says process 1 of 2 but SLURM says process 1 of 4" in msg and "Fix:" in msg


def test_reads_os_environ_by_default(monkeypatch):
    for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.0.2")
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "0")
    monkeypatch.setenv("SKYPILOT_NUM_NODES", "2")
    assert detect_cluster().source == "SkyPilot"
