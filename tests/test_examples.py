"""The examples run (in-process, few steps) and check themselves."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shard_map_loop_matches_reference(capsys):
    _load("shard_map_reduce_gradients.py").main(steps=5)
    assert "max |param - reference|" in capsys.readouterr().out


def test_nnx_example_trains(capsys):
    _load("train_nnx.py").main(["--steps", "60"])
    assert "nnx MLP on 8 devices" in capsys.readouterr().out


def test_gpt_example_restores_on_four_devices(tmp_path, capsys):
    _load("train_gpt.py").main(["--steps", "3", "--out", str(tmp_path)])
    assert "identical params: True" in capsys.readouterr().out
