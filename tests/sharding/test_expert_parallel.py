"""Expert parallelism (``shard(model, experts=[...])``): transformers' Qwen3-MoE and
Mixtral (tiny configs) trained with their experts split across ranks, compiled and
uncompiled, against single-process eager training on the global batch.

Each rank trains on its own rows of a batch whose halves route differently (the second
half one token repeated: every one of its tokens picks the same experts), so the ranks
send each other very different numbers of tokens, and some send none to an expert.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import compshard
from tests.distributed import run_distributed
from tests.real_models import BATCH, _causal, _decoder_kwargs, _quiet_transformers, routing_tokens
from tests.training import RTOL, adamw, local_batch, relative_error, train_reference, train_sharded

STEPS = 3
EXPERTS = ["model.model.layers.*.mlp.experts"]


def build_qwen3_moe(router_aux_loss: bool = False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _quiet_transformers()
    config = Qwen3MoeConfig(
        **_decoder_kwargs(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        output_router_logits=router_aux_loss,
        router_aux_loss_coef=0.01,
    )
    return _causal(Qwen3MoeForCausalLM, config, BATCH * 2, routing_tokens(BATCH * 2))


def build_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet_transformers()
    config = MixtralConfig(**_decoder_kwargs() | dict(intermediate_size=16), num_local_experts=4, num_experts_per_tok=2)
    return _causal(MixtralForCausalLM, config, BATCH * 2, routing_tokens(BATCH * 2))


BUILDERS = {"qwen3-moe": build_qwen3_moe, "qwen3-moe-aux-loss": lambda: build_qwen3_moe(True), "mixtral": build_mixtral}


def _train(rank: int, world_size: int, name: str, compiled: bool, ep: int) -> dict:
    reference, batch = BUILDERS[name]()
    model = copy.deepcopy(reference)
    expert_mesh = None
    if ep != world_size:
        expert_mesh = init_device_mesh("cpu", (ep, world_size // ep), mesh_dim_names=("ep", "dp_shard"))
    compshard.shard(model, experts=EXPERTS, expert_mesh=expert_mesh)
    experts = model.model.model.layers[0].mlp.experts
    held = experts.gate_up_proj._local_tensor.shape[0]
    losses, _ = train_sharded(model, batch, rank, world_size, compiled=compiled, steps=STEPS)
    routed = [int(torch.isin(t, torch.tensor([7])).all()) for t in local_batch(batch, rank, world_size)]
    if name.endswith("aux-loss"):
        expected_losses = _train_reference_per_rank(reference, batch, world_size, compiled)
    else:
        expected_losses = train_reference(reference, batch, STEPS)
    full = compshard.full_state_dict(model)
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "params": {key: relative_error(full[key], value) for key, value in reference.state_dict().items()},
        "held": held,
        "experts": experts.gate_up_proj.shape[0],
        "repeated_token_rows": routed,
    }


def _train_reference_per_rank(reference, batch, world_size: int, compiled: bool) -> list[float]:
    """Single-process training of the unsplit model whose loss is the mean of each rank's
    rows' loss, as data parallelism computes it: the load-balancing loss is not linear in
    the batch (the product of per-expert means), so any data-parallel run, DDP's too,
    trains the mean of the ranks' losses, not the global batch's. ``compiled``: through
    torch's own ``aot_eager``: with the auxiliary loss, torch's compile of the unsplit
    model alone ends 4e-5 (relative) from eager in the attention weights after 3 AdamW
    steps, so a compiled run is held to torch's compiled run."""
    opt = adamw(reference)
    step_model = torch.compile(reference, backend="aot_eager") if compiled else reference
    losses = []
    for _ in range(STEPS):
        loss = sum(step_model(*local_batch(batch, r, world_size)) for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen3-moe-aux-loss"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_experts_split_across_two_ranks_train_as_the_unsplit_model(name, compiled):
    results = run_distributed(_train, 2, name, compiled, 2, timeout=400)
    for rank, result in enumerate(results):
        assert result["loss"] < RTOL, (rank, result["loss"])
        worst = max(result["params"].items(), key=lambda item: item[1])
        assert worst[1] < RTOL, (rank, worst)
        assert result["held"] * 2 == result["experts"]  # each rank holds only its experts


@pytest.mark.parametrize("ep", [4, 2], ids=["ep4", "dp2xep2"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_experts_split_at_world_size_four_train_as_the_unsplit_model(ep, compiled):
    results = run_distributed(_train, 4, "qwen3-moe", compiled, ep, timeout=500)
    for rank, result in enumerate(results):
        assert result["loss"] < RTOL, (rank, result["loss"])
        worst = max(result["params"].items(), key=lambda item: item[1])
        assert worst[1] < RTOL, (rank, worst)
        assert result["held"] * 4 == result["experts"]  # its experts (ep 4), or its half of its pair's (dp 2 x ep 2)


class _Experts(torch.nn.Module):
    """transformers' Qwen3-MoE experts alone, called with hand-made routing."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        _quiet_transformers()
        torch.manual_seed(0)
        config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2)
        self.experts = Qwen3MoeExperts(config)
        torch.nn.init.normal_(self.experts.gate_up_proj, std=0.5)
        torch.nn.init.normal_(self.experts.down_proj, std=0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.experts(hidden, top_k_index, top_k_weights).square().mean()


def _routing(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step``: rank 1 routes every token to experts 2 and 3 (its
    own: it sends rank 0 none), rank 0 to any expert, each step differently; each rank has
    a token count of its own (a new input size is Dynamo's one recompile, as for any model:
    here the routing alone changes from step to step)."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    tokens = 6 + rank
    hidden = torch.randn(tokens, 8, generator=generator)
    if rank == 1:
        index = torch.stack([torch.full((tokens,), 2), torch.full((tokens,), 3)], 1)
    else:
        index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator).softmax(-1)
    return hidden, index, weights


def _within_capacity(index: torch.Tensor, weights: torch.Tensor, factor: float | None) -> torch.Tensor:
    """``weights`` with the pairs beyond each expert's capacity zeroed: of each expert's
    pairs, in token order, the first ``ceil(factor * pairs / experts)`` are kept."""
    if factor is None:
        return weights
    capacity = math.ceil(factor * index.numel() / 4)
    flat = index.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for expert in range(4):
        keep[(flat == expert).nonzero()[:capacity]] = True
    return weights * keep.view_as(weights)


def _uneven_routing(rank: int, world_size: int, compiled: bool, capacity_factor: float | None = None) -> dict:
    from compshard import backend

    reference = _Experts()
    model = compshard.shard(copy.deepcopy(reference), experts=["experts"], expert_capacity_factor=capacity_factor)
    step_model = torch.compile(model, backend="compshard") if compiled else model
    errors = []
    with backend.record_compiles() as compiles:
        for step in range(3):
            hidden, index, weights = _routing(rank, step)
            hidden.requires_grad_()
            step_model(hidden, index, weights).backward()
            expected_hidden = hidden.detach().clone().requires_grad_()
            kept = _within_capacity(index, weights, capacity_factor)
            reference(expected_hidden, index, kept).backward()  # this rank's rows, unsplit
            errors.append(relative_error(hidden.grad, expected_hidden.grad))
            for other in range(world_size):  # the expert gradient sums every rank's tokens
                if other != rank:
                    other_hidden, other_index, other_weights = _routing(other, step)
                    reference(
                        other_hidden, other_index, _within_capacity(other_index, other_weights, capacity_factor)
                    ).backward()
            for name, param in model.experts.named_parameters():
                expected = getattr(reference.experts, name).grad / world_size
                errors.append(relative_error(param.grad.full_tensor(), expected))
            reference.zero_grad()
            model.zero_grad()
    return {"worst": max(errors), "graphs": len(compiles)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_rank_that_sends_a_peer_no_token_neither_hangs_nor_recompiles(compiled):
    results = run_distributed(_uneven_routing, 2, compiled, timeout=300)
    for rank, result in enumerate(results):
        assert result["worst"] < 1e-6, (rank, result)
        if compiled:  # forward and backward once, though each step's token counts differ
            assert result["graphs"] == 2, (rank, result)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_capacity_factor_drops_the_pairs_beyond_each_experts_capacity(compiled):
    # 0.5: of rank 1's 14 pairs, all for experts 2 and 3, each keeps ceil(0.5 * 14 / 4) = 2
    results = run_distributed(_uneven_routing, 2, compiled, 0.5, timeout=300)
    for rank, result in enumerate(results):
        assert result["worst"] < 1e-6, (rank, result)


def _gradients_of_each_implementation(rank: int, world_size: int) -> dict:
    errors = {}
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        reference, batch = build_qwen3_moe()
        reference.model.config._experts_implementation = implementation
        model = compshard.shard(copy.deepcopy(reference), experts=EXPERTS)
        model(*local_batch(batch, rank, world_size)).backward()
        (sum(reference(*local_batch(batch, r, world_size)) for r in range(world_size)) / world_size).backward()
        errors[implementation] = max(
            relative_error(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), reference.parameters())
        )
    return errors


def test_each_experts_implementation_of_transformers_gives_the_unsplit_gradients():
    for rank, errors in enumerate(run_distributed(_gradients_of_each_implementation, 2, timeout=300)):
        assert max(errors.values()) < 1e-6, (rank, errors)


def _inspected(rank: int, world_size: int) -> dict:
    reference, batch = build_qwen3_moe()
    model = compshard.shard(reference, experts=EXPERTS)
    report = compshard.inspect(model, *local_batch(batch, rank, world_size))
    expert_params = {name for name, _ in model.named_parameters() if ".experts." in name}
    return {
        "gathered": [c.params for c in report.collectives if c.kind == "all_gather" and expert_params & set(c.params)],
        "all_to_all": [(c.graph, c.unit, c.bytes) for c in report.collectives if c.kind == "all_to_all"],
        "table": str(report),
    }


def test_inspect_shows_each_layers_all_to_alls_and_no_gather_of_experts():
    result = run_distributed(_inspected, 2, timeout=300)[0]
    assert result["gathered"] == []
    layers = [f"model.model.layers.{i}.mlp.experts" for i in range(2)]
    assert [(graph, unit) for graph, unit, _ in result["all_to_all"]] == [
        ("forward", layers[0]),
        ("forward", layers[1]),
        ("backward", layers[1]),
        ("backward", layers[0]),
    ]
    # rows of 32 fp32 values: 4 rows x 16 tokens x 2 slots per rank, half of them remote
    pairs_bytes = 4 * 16 * 2 * 32 * 4
    assert [b for _, _, b in result["all_to_all"]] == [pairs_bytes + 32] * 2 + [pairs_bytes * 3 // 2] * 2
    assert "expert all_to_all" in result["table"]


def _checkpointed(rank: int, world_size: int, path: str, save: bool) -> dict:
    reference, batch = build_qwen3_moe()
    model = copy.deepcopy(reference)
    expert_mesh = None
    if world_size == 4:
        expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_shard"))
    compshard.shard(model, experts=EXPERTS, expert_mesh=expert_mesh)
    if save:
        train_sharded(model, batch, rank, world_size, compiled=False, steps=1)
        compshard.checkpoint.save(path, model)
    else:
        compshard.checkpoint.load(path, model)
    return {k: v for k, v in compshard.full_state_dict(model).items() if ".experts." in k}


def test_checkpoints_of_split_experts_load_at_another_world_size_and_unsplit(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_checkpointed, 2, path, True, timeout=300)[0]
    loaded = run_distributed(_checkpointed, 4, path, False, timeout=300)[0]  # dp 2 x ep 2
    assert saved.keys() == loaded.keys() and saved
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key
    unsplit, _ = build_qwen3_moe()
    unsplit.load_state_dict(saved, strict=False)  # the full state dict is the unsplit model's
    assert torch.equal(unsplit.state_dict()[key], saved[key])


def _refused(rank: int, world_size: int) -> dict:
    errors = {}
    cases = {
        "unmatched": dict(experts=["model.*.nothing"]),
        "not_a_list": dict(experts="model.model.layers.*.mlp.experts"),
        "interface": dict(experts=["model.model.layers.*.mlp"]),
        "with_gather_units": dict(experts=EXPERTS, gather_units=EXPERTS),
        "strategy": dict(experts=EXPERTS, strategy="no_shard"),
        "capacity": dict(experts=EXPERTS, expert_capacity_factor=0),
        "mesh_without_experts": dict(expert_mesh=init_device_mesh("cpu", (world_size,))),
        "mesh_names": dict(experts=EXPERTS, expert_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))),
    }
    for case, kwargs in cases.items():
        model, _ = build_qwen3_moe()
        try:
            compshard.shard(model, **kwargs)
        except (TypeError, ValueError) as error:
            errors[case] = str(error)
    model, _ = build_mixtral()
    model.model.model.layers[0].mlp.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(3, 32, 32))
    model.model.model.layers[0].mlp.experts.down_proj = torch.nn.Parameter(torch.zeros(3, 32, 16))
    try:
        compshard.shard(model, experts=EXPERTS)
    except ValueError as error:
        errors["indivisible"] = str(error)
    return errors


def test_bad_expert_options_are_refused_naming_the_option():
    errors = run_distributed(_refused, 4, timeout=300)[0]
    assert "experts pattern(s) ['model.*.nothing'] match no submodule" in errors["unmatched"]
    assert "experts must be a non-empty list" in errors["not_a_list"]
    assert "called as forward('hidden_states', 'top_k_index', 'top_k_weights')" in errors["interface"]
    assert "matched by experts and by gather_units" in errors["with_gather_units"]
    assert "experts needs strategy='full_shard' or 'shard_grad_op'" in errors["strategy"]
    assert "expert_capacity_factor must be a number > 0" in errors["capacity"]
    assert "expert_mesh needs experts=" in errors["mesh_without_experts"]
    assert "mesh_dim_names=('ep', 'dp_shard')" in errors["mesh_names"]
    assert "has 3 experts, not divisible by the 4 data-parallel ranks" in errors["indivisible"]
