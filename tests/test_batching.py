"""jaxdp.microbatches: Megatron's global = micro x num_microbatches x dp, checked with fixes."""

import pytest

from jaxdp import microbatches


@pytest.mark.parametrize(("gb", "mb", "dp", "want"), [(256, 8, 8, 4), (64, 8, 8, 1), (36, 2, 6, 3)])
def test_valid(gb, mb, dp, want):
    assert microbatches(gb, mb, dp) == want


def test_error_names_all_three_and_nearest_choices():
    with pytest.raises(ValueError) as e:
        microbatches(96, 8, 8)
    msg = str(e.value)
    for part in ("global_batch=96", "8 x 8 = 64", "global_batch=64 or 128", "micro_batch=4 or 6"):
        assert part in msg, msg
    with pytest.raises(ValueError, match=r"global_batch=100.*not even divisible by dp=8"):
        microbatches(100, 8, 8)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((0, 1, 1), ValueError, "global_batch=0"),
        ((8, 1.5, 1), TypeError, "micro_batch=1.5"),
        ((8, 1, True), TypeError, "dp=True"),
    ],
)
def test_bad_types(args, exc, match):
    with pytest.raises(exc, match=match):
        microbatches(*args)
