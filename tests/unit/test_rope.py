"""The drafter's RoPE is the target's (``trainer.model.rope``): for plain, linear, YaRN and
llama3 scaling, ``rotary`` equals Qwen3's own rotary embedding for the same config, bit for
bit, at positions up to 64K; the drafter config takes the scaling from the target's config;
what no fixed rotation can serve is refused, naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from trainer.model.drafter import DrafterConfig
from trainer.model.rope import check_scaling, rotary, scaling_from_config

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": YARN,
    "yarn, beta and mscale set": {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.2},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}  # fmt: skip


def qwen3(scaling, theta: float = 1e6, head_dim: int = 128) -> Qwen3Config:
    rope = {} if scaling is None else {"rope_scaling": dict(scaling)}
    return Qwen3Config(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        intermediate_size=1024, num_hidden_layers=2, max_position_embeddings=65536,
        rope_theta=theta, **rope,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotary_is_qwen3_s_rotary_embedding(name):
    config = qwen3(SCALINGS[name])
    positions = torch.cat([torch.arange(64), torch.arange(8000, 65536, 997)])[None]
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), positions)
    cfg = DrafterConfig.from_target(config, num_target_layers=3)
    mine = rotary(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(mine[0], cos) and torch.equal(mine[1], sin)
    if name != "default":  # and the scaling is not a no-op at these positions
        plain = rotary(positions, cfg.head_dim, cfg.rope_theta)
        assert not torch.allclose(plain[0], cos, atol=1e-3)


def test_the_drafter_config_takes_the_target_s_scaling():
    cfg = DrafterConfig.from_target(qwen3(YARN, theta=5e5), num_target_layers=3)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, YARN)
    assert DrafterConfig.from_target(qwen3(None), num_target_layers=3).rope_scaling is None
    assert cfg.to_dict()["rope_scaling"] == YARN  # what a checkpoint records


def test_scaling_from_older_and_partial_configs():
    # Transformers 4.x spelling: rope_scaling with "type"
    old = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0})
    assert scaling_from_config(old) == {"rope_type": "linear", "factor": 2.0}
    # YaRN without a factor: derived as Transformers derives it
    rope = {"rope_type": "yarn", "original_max_position_embeddings": 4096}
    no_factor = SimpleNamespace(rope_parameters=rope, max_position_embeddings=32768)
    assert scaling_from_config(no_factor)["factor"] == 8.0
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert scaling_from_config(plain) is None


@pytest.mark.parametrize(
    ("scaling", "needle"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' changes its frequencies"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' changes"),
        ({"rope_type": "mrope", "factor": 2.0}, "rope_type 'mrope' is none of default"),
        ({**YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({**YARN, "factor": [8.0]}, "factor = [8.0] is not a number"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs original_max_position_embeddings"),
        ({"rope_type": "linear"}, "'linear' needs factor"),
    ],
)
def test_what_cannot_be_rotated_as_the_target_does_is_refused(scaling, needle):
    with pytest.raises(ValueError, match="rope_scaling: ") as err:
        check_scaling(scaling)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match=needle.split(" ")[0]):
        DrafterConfig(
            hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
            num_target_layers=1, rope_scaling=scaling,
        )  # fmt: skip
