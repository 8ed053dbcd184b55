"""module_tree: repeated blocks and module-name patterns, from dotted names alone."""

from __future__ import annotations

from torch import nn

from compshard.module_tree import module_of, outermost_match, repeated_block, repeated_containers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(4, 10)


def test_module_of_drops_the_parameter_name():
    assert module_of("blocks.0.mlp.2.weight") == "blocks.0.mlp.2"
    assert module_of("bias") == ""  # a parameter of the root module


def test_a_modules_numbered_children_make_it_a_container_of_repeated_blocks():
    modules = [name for name, _ in Decoder().named_modules()]
    # blocks has three numbered children; each block's Sequential has 0, 1 and 2
    assert repeated_containers(modules) == {"blocks", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"}


def test_one_numbered_child_is_not_a_repeat():
    assert repeated_containers(["encoder.0.fc", "encoder.0.norm", "head"]) == set()
    assert repeated_containers(["encoder.0.fc", "encoder.1.fc"]) == {"encoder"}


def test_numbers_must_be_whole_path_components():
    # ResNet's layer1 / layer2 are names, not numbers; their own children are numbered
    modules = ["layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1"]
    assert repeated_containers(modules) == {"layer1"}
    assert repeated_containers(["blocks.0", "blocks.10"]) == {"blocks"}  # 0 and 10 are two children


def test_each_parameter_lies_in_its_outermost_repeated_block():
    model = Decoder()
    containers = repeated_containers(name for name, _ in model.named_modules())
    blocks = {name: repeated_block(module_of(name), containers) for name, _ in model.named_parameters()}
    assert blocks["blocks.1.mlp.2.weight"] == "blocks.1"  # not blocks.1.mlp.2: the outer block wins
    assert blocks["blocks.0.mlp.0.bias"] == "blocks.0"
    assert blocks["embed.weight"] is None and blocks["head.bias"] is None


def test_experts_inside_a_layer_belong_to_the_layer():
    modules = ["layers.0.experts.0.w", "layers.0.experts.1.w", "layers.1.experts.0.w", "layers.1.experts.1.w"]
    containers = repeated_containers(modules)
    assert containers == {"layers", "layers.0.experts", "layers.1.experts"}
    assert repeated_block("layers.1.experts.0.w", containers) == "layers.1"
    assert repeated_block("layers.1.experts.0.w", {"layers.1.experts"}) == "layers.1.experts.0"


def test_a_numbered_child_of_a_module_that_is_not_a_container_is_no_block():
    assert repeated_block("blocks.0.fc", {"layers"}) is None
    assert repeated_block("blocks", {"blocks"}) is None  # the container itself is in no block


def test_outermost_match_returns_the_shortest_matching_prefix():
    assert outermost_match("moe.experts.3", ["moe"]) == "moe"
    assert outermost_match("moe.experts.3", ["*.experts.*"]) == "moe.experts.3"
    # both patterns match some prefix: the shorter one wins, whichever pattern comes first
    assert outermost_match("layers.1.mlp", ["layers.1.mlp", "layers.*"]) == "layers.1"


def test_outermost_match_is_none_without_a_match_and_for_the_root():
    assert outermost_match("blocks.0.attn", ["head", "blocks.1*"]) is None
    assert outermost_match("", ["*"]) is None
    assert outermost_match("Blocks.0", ["blocks.*"]) is None  # case-sensitive
