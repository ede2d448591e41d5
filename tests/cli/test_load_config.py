"""`psr.LoadConfig`: the one definition of the load options, and the command line's load
flags held equal to it (names and defaults)."""

from __future__ import annotations

import dataclasses

import pytest

from psr.cli import build_parser
from psr.cli.generate import NOT_FLAGS, PLACEMENT_FLAGS, POLICY_FLAGS, load_options
from psr.load_config import LoadConfig

CLI_ONLY = {"hybrid_m"}  # joined into experts_on


def test_every_option_is_a_flag_or_says_why_not() -> None:
    fields = {f.name for f in dataclasses.fields(LoadConfig)}
    flags = set(POLICY_FLAGS) | set(PLACEMENT_FLAGS)
    assert not set(POLICY_FLAGS) & set(PLACEMENT_FLAGS)
    assert flags - CLI_ONLY <= fields, flags - CLI_ONLY - fields
    assert fields - flags == set(NOT_FLAGS)


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_the_flags_defaults_are_the_configs(command: list[str]) -> None:
    cfg = LoadConfig.of("load", **load_options(build_parser().parse_args(command)))
    want = LoadConfig()
    for f in dataclasses.fields(LoadConfig):
        if f.name == "expert_format":  # the flag spells the default 'native'
            assert cfg.store_format == want.store_format is None
        else:
            assert getattr(cfg, f.name) == getattr(want, f.name), f.name


def test_flags_reach_the_config() -> None:
    argv = ["generate", "--prompt", "x", "--policy", "cache-prior", "--residency", "0.25"]
    argv += ["--experts-on", "hybrid", "--hybrid-m", "1,2", "--no-graphs", "--block-k", "3"]
    argv += ["--expert-format", "int8", "--host-memory", "1GiB", "--dtype", "bf16"]
    argv += ["--gpu-memory", "24GB"]
    cfg = LoadConfig.of("load", **load_options(build_parser().parse_args(argv)))
    assert cfg.gpu_memory == "24GB" and not cfg.plans_slots  # --residency given: checked
    assert (cfg.policy, cfg.residency, cfg.block_k) == ("cache-prior", 0.25, 3)
    assert cfg.placement == ("hybrid", [1, 2]) and cfg.graphs is False
    assert (cfg.store_format, cfg.host_memory, cfg.dtype) == ("int8", "1GiB", "bfloat16")


def test_unknown_and_load_only_keywords_are_type_errors() -> None:
    with pytest.raises(TypeError, match=r"^load\(\) got an unexpected keyword argument 'beams'$"):
        LoadConfig.of("load", beams=2)
    # offload takes the options that apply to a built model only
    with pytest.raises(TypeError, match=r"^offload\(\) got an unexpected keyword .* 'device'$"):
        LoadConfig.of("offload", device="cpu")
    assert "device" in LoadConfig.option_names()
    assert "device" not in LoadConfig.option_names(offload_only=True)
    assert LoadConfig.of("offload", experts_on="cpu").placement == ("cpu", None)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"compute": "gpu"}, "compute must be one of auto, triton, torch; got 'gpu'"),
        ({"decode": "fast"}, "decode must be one of device, host; got 'fast'"),
        ({"graphs": "yes"}, "graphs must be True, False or 'auto'; got 'yes'"),
        ({"experts_on": "tpu"}, "experts_on must be one of gpu, cpu, hybrid; got 'tpu'"),
        ({"expert_format": "int3"}, "expert_format must be one of native, bf16, int8"),
        ({"policy": "lru"}, "unknown policy 'lru'"),
        ({"dtype": "int8"}, "unsupported dtype 'int8'"),
        ({"host_memory": "lots"}, "host_memory must be a size like '48GB'"),
        ({"gpu_memory": "24 gigs"}, "gpu_memory must be a size like '48GB'"),
        ({"gpu_memory": -1}, "gpu_memory must be >= 0 bytes, got -1"),
    ],
)
def test_bad_options_fail_with_one_line_before_anything_loads(options, error) -> None:
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(")) as e:
        LoadConfig(**options)
    assert "\n" not in str(e.value)


def test_frozen_and_replace() -> None:
    cfg = LoadConfig(residency=0.25, policy="exact")
    assert LoadConfig.of("load", **cfg.options()) == cfg  # what psr.load(path, **...) builds
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.residency = 0.5  # type: ignore[misc]
    assert cfg.replace(slots=4).slots == 4 and cfg.slots is None
    with pytest.raises(ValueError, match="compute must be one of"):
        cfg.replace(compute="gpu")  # a changed config is checked again
