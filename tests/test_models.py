"""Model configs: the Llama-3 shapes build on the meta device with the published parameter
counts."""

import pytest
from hydra import compose, initialize_config_module

from composer3d.config.registration import register_configs
from composer3d.models import build_model, count_params

PUBLISHED = {  # parameter counts of the released checkpoints
    "llama3_1b": 1_235_814_400,  # Llama-3.2-1B (tied embeddings)
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama3_shapes_match_published_sizes(name):
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train", overrides=[f"model={name}"])
    model = build_model(cfg.model)  # meta: no memory
    assert count_params(model) == PUBLISHED[name]
    assert next(model.parameters()).is_meta
