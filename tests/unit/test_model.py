"""Model shapes: parameter counts, a forward pass, tied embeddings."""

import torch

from atoll.models.configs import MODELS, get_model_config
from atoll.models.gpt import GPT, GPTConfig


def test_param_counts_match_instantiated_models():
    for name in ("nano", "tiny", "small"):
        model = GPT(MODELS[name])
        assert sum(p.numel() for p in model.parameters()) == MODELS[name].num_params


def test_planning_shapes():
    assert 11e9 < MODELS["12b"].num_params < 13e9
    assert 0.9e9 < MODELS["1b"].num_params < 1.1e9


def test_forward_is_finite_and_embeddings_are_tied():
    cfg = get_model_config("nano")
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    loss = model(x[:, :-1], x[:, 1:])
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert not any(n.startswith("head") for n, _ in model.named_parameters())


def test_bad_shapes_are_rejected():
    import pytest

    with pytest.raises(ValueError):
        GPTConfig(d_model=100, n_heads=3)
    with pytest.raises(KeyError, match="known"):
        get_model_config("nope")
