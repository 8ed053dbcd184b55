"""Real-model zoo for the parity suite: tiny, randomly initialised models built from configs.

Nothing is downloaded: every model is constructed from a config (transformers), a
constructor (torchvision) or a model name with ``pretrained=False`` (timm), under fixed
seeds, with dropout off. Each entry returns ``(module, batch)``: ``module(*batch)`` is a
scalar loss, a mean over the batch's rows (or tokens) unless the entry says
``reduction="sum"``, and ``batch`` is one global batch whose dim 0 the ranks split.

Importing this module makes torchvision's pure-Python modules importable even where its
compiled ops were built for another torch (see ``ensure_torchvision_importable``), so
spawned workers, which import it to unpickle their worker function, get the same fix as
the pytest process (``tests/conftest.py``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- torchvision


def ensure_torchvision_importable() -> str:
    """Make ``import torchvision.<submodule>`` work; return how: ``"native"`` (the real
    package imported fine and is used as is), ``"shim"`` (see below) or ``"absent"``.

    A torchvision wheel built for another torch (the registry's CUDA wheel next to a CPU
    torch) fails in ``torchvision/__init__.py``: its compiled ops do not load and
    ``_meta_registrations`` then registers fakes for operators that do not exist. The
    model definitions themselves are pure Python, and transformers and timm import them
    (transformers imports torchvision whenever it is installed). So when the real import
    fails, this registers an empty package module named ``torchvision`` whose search path
    is the installed package folder: submodules (``torchvision.models.resnet``,
    ``torchvision.ops.misc``) then import from the files as usual, and only the package's
    ``__init__`` (the compiled-ops loading) is skipped. The decision is made by trying the
    real import, so a working torchvision is always the one used.
    """
    current = sys.modules.get("torchvision")
    if current is not None:
        return "shim" if getattr(current, "__compshard_test_shim__", False) else "native"
    spec = importlib.util.find_spec("torchvision")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    try:
        import torchvision  # noqa: F401

        return "native"
    except Exception:  # noqa: BLE001 - any failure of the compiled part: fall back to the shim
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    package = types.ModuleType("torchvision")
    package.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    package.__spec__.submodule_search_locations = list(spec.submodule_search_locations)
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__compshard_test_shim__ = True
    sys.modules["torchvision"] = package
    try:
        from torchvision.version import __version__

        package.__version__ = __version__
    except ImportError:
        pass
    return "shim"


TORCHVISION = ensure_torchvision_importable()

# ---------------------------------------------------------------------------------- sizes

VOCAB = 64
SEQ = 16
BATCH = 4  # global rows; each of 2 ranks gets 2
IMAGE = 32


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _tokens(rows: int = BATCH, length: int = SEQ, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=generator or _generator())


def _images(rows: int = BATCH, size: int = IMAGE) -> tuple[torch.Tensor, torch.Tensor]:
    generator = _generator()
    return torch.randn(rows, 3, size, size, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


# ------------------------------------------------------------------------------- wrappers


class CausalLM(nn.Module):
    """A transformers ``*ForCausalLM``: the loss is the model's own (labels = inputs, shifted
    inside), a mean over every row's ``SEQ - 1`` predicted tokens, so equal halves
    average to the global loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


class LabelledLM(nn.Module):
    """A transformers model taking ``labels`` (BERT's masked LM: every position labelled, so
    no -100 makes the token count differ between ranks; T5: labels are the decoder's
    targets)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class Classifier(nn.Module):
    """An image model's logits through a mean cross-entropy."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), targets)


class InPlaceOutput(nn.Module):
    """The smallest known failure: an in-place op on an activation whose return value is
    unused. Dropping ``mul_`` (FX dead-code elimination on a Dynamo graph) halves the loss
    and the gradients. The loss is a sum (``reduction="sum"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.mul_(2)
        return h.sum()


class ConvBN(nn.Module):
    """Conv, BatchNorm (running statistics and ``num_batches_tracked``, an int64 buffer
    incremented in place every training forward), ReLU, pooling, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(images)))
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), targets)


# -------------------------------------------------------------------------------- builders


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def _decoder_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
    )


def _causal(model_cls, config, rows: int, tokens: torch.Tensor | None = None):
    torch.manual_seed(0)
    model = CausalLM(model_cls(config))
    model.train()
    return model, (_tokens(rows) if tokens is None else tokens,)


def routing_tokens(rows: int = BATCH) -> torch.Tensor:
    """MoE batch whose halves route differently: the first half random tokens (which hit
    every expert), the second half one token repeated. Every position of a repeated-token
    row carries the same hidden state through every layer (attention over identical values
    returns that value), so rank 1's tokens all pick the same top-k experts: fewer experts
    are hit on rank 1 than on rank 0."""
    first = rows // 2
    return torch.cat([_tokens(first), torch.full((rows - first, SEQ), 7)])


def build_gpt2(rows: int = BATCH):
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )  # lm_head tied to wte
    return _causal(GPT2LMHeadModel, config, rows)


def build_llama(rows: int = BATCH, gradient_checkpointing: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    model, batch = _causal(LlamaForCausalLM, LlamaConfig(**_decoder_kwargs()), rows)
    if gradient_checkpointing:
        model.model.gradient_checkpointing_enable()
        assert model.model.is_gradient_checkpointing
    return model, batch


def build_qwen2(rows: int = BATCH):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _quiet_transformers()
    return _causal(Qwen2ForCausalLM, Qwen2Config(**_decoder_kwargs()), rows)  # q/k/v biases


def build_gemma2(rows: int = BATCH):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    _quiet_transformers()
    # attention and final logit soft-capping (tanh), a sliding-window layer beside a global
    # one, RMSNorm before and after each sub-layer, embeddings scaled by sqrt(width)
    config = Gemma2Config(
        **_decoder_kwargs(), head_dim=8, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    )
    return _causal(Gemma2ForCausalLM, config, rows)


def build_phi3(rows: int = BATCH):
    from transformers import Phi3Config, Phi3ForCausalLM

    _quiet_transformers()
    # one fused qkv and one fused gate_up projection, each split in the forward
    return _causal(Phi3ForCausalLM, Phi3Config(**_decoder_kwargs(), pad_token_id=0), rows)


def build_gpt_neox(rows: int = BATCH):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    _quiet_transformers()
    # attention and MLP in parallel off one residual; rotary on a quarter of each head
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.25,
        use_parallel_residual=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cache=False,
    )
    return _causal(GPTNeoXForCausalLM, config, rows)


def build_olmo_clip_qkv(rows: int = BATCH, clip_qkv: float | None = 0.5):
    from transformers import OlmoConfig, OlmoForCausalLM

    _quiet_transformers()
    # init std 0.2 makes q/k/v exceed the clip often (asserted by the test), so the in-place
    # clamp_ changes the result
    return _causal(OlmoForCausalLM, OlmoConfig(**_decoder_kwargs(), clip_qkv=clip_qkv, initializer_range=0.2), rows)


def build_deepseek_v3_mla(rows: int = BATCH):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    _quiet_transformers()
    kwargs = _decoder_kwargs() | dict(num_key_value_heads=4)
    # every layer dense (first_k_dense_replace = layers): this entry is about MLA attention,
    # whose key states are a new_empty tensor filled by two slice copy_s
    config = DeepseekV3Config(
        **kwargs,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_group=1,
        topk_group=1,
        num_mtp_layers=0,
    )
    return _causal(DeepseekV3ForCausalLM, config, rows)


def build_mixtral_eager_experts(rows: int = BATCH):
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet_transformers()
    # "eager": MixtralExperts.forward loops over the experts hit by this batch's tokens
    # (torch.nonzero of the routing mask), so the loop depends on each rank's data
    config = MixtralConfig(
        **_decoder_kwargs() | dict(intermediate_size=32),
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    model, batch = _causal(MixtralForCausalLM, config, rows, routing_tokens(rows))
    assert model.model.config._experts_implementation == "eager"
    return model, batch


def build_qwen2_moe(rows: int = BATCH):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    _quiet_transformers()
    # the default experts implementation (batched over all experts, routing as data)
    config = Qwen2MoeConfig(
        **_decoder_kwargs(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    )
    return _causal(Qwen2MoeForCausalLM, config, rows, routing_tokens(rows))


def build_bert(rows: int = BATCH):
    from transformers import BertConfig, BertForMaskedLM

    _quiet_transformers()
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = LabelledLM(BertForMaskedLM(config))
    model.train()
    generator = _generator()
    return model, (_tokens(rows, generator=generator), _tokens(rows, generator=generator))


def build_t5(rows: int = BATCH):
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LabelledLM(T5ForConditionalGeneration(config))
    model.train()
    generator = _generator()
    return model, (_tokens(rows, generator=generator), _tokens(rows, length=8, generator=generator))


def build_torchvision_resnet18(rows: int = BATCH):
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return Classifier(resnet18(num_classes=10)), _images(rows)


def build_timm_resnet(rows: int = BATCH):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10, channels=(8, 16, 32, 64))
    return Classifier(model), _images(rows)


def build_torchvision_vit(rows: int = BATCH):
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=IMAGE, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    return Classifier(model), _images(rows)


def build_timm_vit(rows: int = BATCH):
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=IMAGE,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=10,
    )
    return Classifier(model), _images(rows)


def build_inplace(rows: int = BATCH):
    torch.manual_seed(0)
    return InPlaceOutput(), (torch.randn(rows, 8, generator=_generator()),)


def build_conv_bn(rows: int = BATCH):
    torch.manual_seed(0)
    return ConvBN(), _images(rows, size=8)


def build_repo_gpt(rows: int = BATCH):
    from compshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=_generator())
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# ------------------------------------------------------------------------------------ zoo


@dataclass(frozen=True)
class RealModel:
    """One zoo entry. ``batch_norm``: training-mode BatchNorm, whose statistics are those of
    each rank's local batch (see the test for the reference used); ``reduction``: how the
    loss combines rows ("mean" or "sum"); ``known_issue``: the library behaviour this
    entry is there to catch."""

    name: str
    build: Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]  # build(rows=BATCH)
    kind: str
    batch_norm: bool = False
    reduction: str = "mean"
    known_issue: str = ""


ZOO: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel("gpt2", build_gpt2, "decoder LM (tied head, Conv1D)"),
        RealModel("llama", build_llama, "decoder LM (RoPE, GQA, RMSNorm)"),
        RealModel("qwen2", build_qwen2, "decoder LM (qkv bias)"),
        RealModel(
            "llama-grad-ckpt",
            lambda rows=BATCH: build_llama(rows, gradient_checkpointing=True),
            "decoder LM, HF gradient checkpointing",
        ),
        RealModel("gemma2", build_gemma2, "decoder LM (soft-capping, sliding window, sandwich norms)"),
        RealModel("phi3", build_phi3, "decoder LM (fused qkv and gate_up projections)"),
        RealModel("gpt-neox", build_gpt_neox, "decoder LM (parallel residual, partial rotary)"),
        RealModel(
            "olmo-clip-qkv",
            build_olmo_clip_qkv,
            "decoder LM, clip_qkv",
            known_issue="in-place clamp_ on q/k/v whose results are unused",
        ),
        RealModel(
            "deepseek-v3-mla",
            build_deepseek_v3_mla,
            "decoder LM, MLA attention",
            known_issue="key states: new_empty filled by slice copy_",
        ),
        RealModel("bert", build_bert, "MLM encoder"),
        RealModel("t5", build_t5, "encoder-decoder (tied, relative position bias)"),
        RealModel(
            "mixtral-eager-experts",
            build_mixtral_eager_experts,
            "MoE, loop over routed experts",
            known_issue="data-dependent loop (nonzero) over experts: graph break, per-rank control flow",
        ),
        RealModel("qwen2-moe", build_qwen2_moe, "MoE, default experts (routing as data), shared expert"),
        RealModel("torchvision-resnet18", build_torchvision_resnet18, "CNN with BatchNorm", batch_norm=True),
        RealModel("timm-resnet", build_timm_resnet, "CNN with BatchNorm (timm, tiny channels)", batch_norm=True),
        RealModel("torchvision-vit", build_torchvision_vit, "ViT (torchvision)"),
        RealModel("timm-vit", build_timm_vit, "ViT (timm)"),
        RealModel(
            "inplace-mul",
            build_inplace,
            "minimal in-place module",
            reduction="sum",
            known_issue="h.mul_(2) whose result is unused",
        ),
        RealModel(
            "conv-bn",
            build_conv_bn,
            "BatchNorm buffers",
            batch_norm=True,
            known_issue="num_batches_tracked.add_(1) on a buffer",
        ),
        RealModel("repo-gpt", build_repo_gpt, "compshard.models.GPT"),
    )
}


# ------------------------------------------------------- parameters gathered during a backward


class ReentrantCheckpointMLP(nn.Module):
    """``Linear(8, 16)``, two blocks each run through ``checkpoint(..., use_reentrant=True)``,
    then a ``Linear(16, 4)`` head: the blocks' forward runs without autograd and their
    parameters are gathered again by the recompute inside the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.head(h).square().mean()


class _ReversibleCoupling(torch.autograd.Function):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)`` without saving the inputs: the backward
    reconstructs them from the outputs and runs ``g`` and ``f`` again (reading their
    parameters) under a nested ``torch.autograd.backward``, as RevNet and Reformer do."""

    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.block = block
        y1 = x1 + block.f(x2)
        y2 = x2 + block.g(y1)
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1: torch.Tensor, dy2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        y1, y2 = (y.detach() for y in ctx.saved_tensors)
        with torch.enable_grad():
            y1.requires_grad_()
            g = ctx.block.g(y1)
            torch.autograd.backward(g, dy2)
        dy1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = (y2 - g.detach()).requires_grad_()
            torch.autograd.backward(ctx.block.f(x2), dy1)
        return dy1, dy2 + x2.grad, None


class ReversibleBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.g = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _ReversibleCoupling.apply(x1, x2, self)


class RevNet(nn.Module):
    """``Linear(8, 16)``, two reversible blocks on the halves of the width, ``Linear(16, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(ReversibleBlock(8) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.inp(x).chunk(2, dim=-1)
        for block in self.blocks:
            x1, x2 = block(x1, x2)
        return self.head(torch.cat([x1, x2], dim=-1)).square().mean()


def build_reentrant_checkpoint_mlp(rows: int = BATCH):
    torch.manual_seed(0)
    return ReentrantCheckpointMLP(), (torch.randn(rows, 8, generator=_generator()),)


def build_revnet(rows: int = BATCH):
    torch.manual_seed(0)
    return RevNet(), (torch.randn(rows, 8, generator=_generator()),)


def build_llama_reentrant_checkpointing(rows: int = BATCH):
    model, batch = build_llama(rows)
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.model.is_gradient_checkpointing
    return model, batch


ZOO.update(
    {
        m.name: m
        for m in (
            RealModel(
                "reentrant-checkpoint-mlp",
                build_reentrant_checkpoint_mlp,
                "torch checkpoint(use_reentrant=True)",
                known_issue="parameters gathered again by the recompute inside the backward",
            ),
            RealModel(
                "llama-reentrant-ckpt",
                build_llama_reentrant_checkpointing,
                "decoder LM, HF gradient checkpointing (use_reentrant=True)",
                known_issue="every layer's parameters gathered inside the backward",
            ),
            RealModel(
                "revnet",
                build_revnet,
                "reversible blocks (RevNet coupling)",
                known_issue="inputs reconstructed and parameters read again in the backward",
            ),
        )
    }
)
