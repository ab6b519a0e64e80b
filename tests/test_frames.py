"""jaxdp's engine frames are JAX's own in source locations (jaxdp._frames)."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax
from _models import make_batch, mlp_params, mse_loss
from jax._src import source_info_util as siu  # is_user_filename: not in jax.extend

import jaxdp
from jaxdp import DataParallel, DDPConfig, make_mesh
from jaxdp._src.platform.frames import ENV, engine_prefix, exclude_engine_frames


def _files(text):
    """The source files the lowered program's locations name."""
    return {
        line.split('"')[1] for line in text.splitlines() if line.startswith("#loc") and '"' in line
    }


def _set_exclusions(paths):
    """Replace jax's excluded path prefixes (and drop the caches that remember them)."""
    siu._exclude_paths[:] = paths
    siu._exclude_path_regex.cache_clear()
    siu.is_user_filename.cache_clear()


def test_engine_frames_are_not_user_frames_but_model_code_is():
    import jaxdp._src.engine.engine
    import jaxdp.models
    import jaxdp.nn

    assert engine_prefix().endswith(os.path.join("jaxdp", "_"))
    assert not siu.is_user_filename(jaxdp._src.engine.engine.__file__)
    assert not siu.is_user_filename(jaxdp.__file__)
    # the model code jaxdp ships keeps its frames, as flax.linen's layers do
    assert siu.is_user_filename(jaxdp.models.__file__)
    assert siu.is_user_filename(jaxdp.nn.__file__)


def test_the_steps_locations_name_the_users_code_and_no_engine_module():
    """Every stage's lowered step: the model's operations located in the user's file (the
    loss, tests/_models.py), none in jaxdp/_*.py."""
    for stage in (0, 1, 3):
        cfg = DDPConfig(zero_stage=stage, bucket_size=200)
        dp = DataParallel(mse_loss, optax.adam(1e-3), cfg, mesh=make_mesh())
        state = dp.init(mlp_params())
        files = _files(
            dp.step.lower(state, dp.shard_batch(make_batch(64))).as_text(debug_info=True)
        )
        assert any(f.endswith("_models.py") for f in files), files
        assert not any(f.startswith(engine_prefix()) for f in files), files


def test_the_environment_keeps_the_engine_frames():
    """``JAXDP_SOURCE_FRAMES=1`` at import: jaxdp's modules are user frames again (for
    debugging jaxdp itself); the switch is read once, at import."""
    assert exclude_engine_frames({ENV: "1"}) is False
    assert exclude_engine_frames({ENV: "yes"}) is False
    code = (
        "import jaxdp, jaxdp._src.engine.engine\n"
        "from jax._src import source_info_util as s\n"
        "print(s.is_user_filename(jaxdp._src.engine.engine.__file__))"
    )
    for value, expected in (("1", "True"), ("0", "False")):
        env = {**os.environ, ENV: value, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip().splitlines()[-1] == expected


def test_same_program_with_and_without_the_engine_frames():
    """Locations are metadata: the compiled step computes the same bits either way."""
    cfg = DDPConfig(zero_stage=1, bucket_size=200)

    def run():
        dp = DataParallel(mse_loss, optax.adam(1e-3), cfg, mesh=make_mesh())
        state = dp.init(mlp_params())
        state, _ = dp.step(state, dp.shard_batch(make_batch(64)))
        return jax.tree.leaves(dp.params(state))

    hidden = run()
    before = list(siu._exclude_paths)
    _set_exclusions([p for p in before if p != engine_prefix()])
    try:
        assert siu.is_user_filename(jaxdp.__file__)
        shown = run()
    finally:
        _set_exclusions(before)
    for a, b in zip(hidden, shown, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_jax_without_the_hook_leaves_the_locations_alone(monkeypatch):
    """Locations are metadata: where jax has no ``register_exclusion`` jaxdp imports and runs
    as before, with its frames in the locations."""
    import jax.extend.source_info_util as public

    monkeypatch.delattr(public, "register_exclusion")
    assert exclude_engine_frames({}) is False
