"""Tier 1: engine spec strings (moe_engine/factory.py) name the engine and its settings."""
import pytest

from moe_engine import FasterMoE, MoEConfig, MPipeMoE, build_layer
from moe_engine.factory import EngineSpec


def test_a_spec_names_the_engine_and_its_settings():
    assert EngineSpec.parse("mpipemoe:16:S3:peers") == EngineSpec("mpipemoe", 16, "S3", split="peers")
    assert EngineSpec.parse("mpipemoe:auto") == EngineSpec("mpipemoe", "auto")
    assert EngineSpec.parse("fastermoe:4") == EngineSpec("fastermoe", group_size=4)
    layer = build_layer("mpipemoe:1:S4:peers", MoEConfig(8, 16, 4))
    assert isinstance(layer, MPipeMoE) and (layer.partitions, layer.strategy, layer.split) == (1, "S4", "peers")
    assert isinstance(build_layer("fastermoe:2", MoEConfig(8, 16, 4)), FasterMoE)


@pytest.mark.parametrize("spec, message", [
    ("dense", r"engine='dense' is unknown"),
    ("fastmoe:2", r"fastmoe takes at most 0 setting"),
    ("mpipemoe:two", r"'two' is not an integer"),
    ("mpipemoe:2:S9", r"strategy 'S9'"),
    ("mpipemoe:2:S1:halves", r"split 'halves': choose one of tokens, peers, auto"),
    ("mpipemoe:2:S1:peers:x", r"mpipemoe takes at most 3 setting"),
])
def test_a_bad_spec_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineSpec.parse(spec)


def test_a_setting_given_twice_must_agree():
    with pytest.raises(ValueError, match=r"split='tokens' contradicts the engine spec"):
        build_layer("mpipemoe:1:none:peers", MoEConfig(8, 16, 4), split="tokens")
