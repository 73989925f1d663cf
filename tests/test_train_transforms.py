"""The model transforms (ampaudit.train.transforms): the order the trainer applies is the one its docstring and README
document; a transform after a later one is refused; checkpointing, plan and FSDP together still train."""
import re

import pytest
import torch
from conftest import ASSETS, ROOT, load_module

from ampaudit.errors import TrainError
from ampaudit.train import Trainer, transforms

BLOCKS = ASSETS / "train_blocks.py"


@pytest.fixture(scope="module")
def blocks():
    return load_module(BLOCKS)


def _documented() -> tuple[list[str], list[str]]:
    """The order as the module docstring's numbered list and README's train section say it."""
    module = re.findall(r"^\d\. ``(\w+)``", transforms.__doc__, flags=re.MULTILINE)
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("Model transforms apply"))
    readme = re.findall(r"`(\w+)`", line.split(":", 1)[1])
    return module, readme


def test_the_order_is_documented_the_same_everywhere():
    module, readme = _documented()
    assert module == readme == list(transforms.ORDER)


def _plan(model) -> dict:
    """A plan with one float8 layer per block (32 -> 64: aligned for float8)."""
    return {"version": 2, "layers": [
        {"module": f"blocks.{i}.up", "choice": "float8_tensorwise", "shape": {"in_features": 32, "out_features": 64}}
        for i in range(len(model.blocks))]}


def test_a_trainer_applies_every_transform_in_the_documented_order(blocks):
    pytest.importorskip("torchao")
    model = blocks.build_model()
    transforms.apply_plan(model, _plan(model), device="cpu")
    with Trainer(model, blocks.loss_fn, blocks.train_data, dtype="bfloat16", fsdp=True, compile="aot_eager",
                 checkpoint_activations="Block", handle_signals=False) as trainer:
        assert trainer.transforms == _documented()[0]
        assert type(model.blocks[0].up).__name__ == "Float8Linear"       # the plan's module, checkpointed


def test_a_transform_after_a_later_one_is_refused(blocks):
    model = blocks.build_model()
    transforms.compile_model(model, "aot_eager")
    with pytest.raises(TrainError, match="activation_checkpointing transform cannot follow compile"):
        transforms.checkpoint_activations(model, "auto")
    assert not any("forward" in m.__dict__ for m in model.modules())     # refused before it changed anything
    assert transforms.applied(model) == ["compile"]


def test_a_model_trained_twice_goes_through_its_transforms_again(blocks):
    model = blocks.build_model()
    for _ in range(2):
        with Trainer(model, blocks.loss_fn, blocks.train_data, dtype="bfloat16", checkpoint_activations="auto",
                     handle_signals=False) as trainer:
            assert trainer.transforms == ["activation_checkpointing"]
            trainer.fit(steps=1)


def test_leaving_the_trainer_gives_a_compiled_model_its_eager_calls_back(blocks):
    model, compiling = blocks.build_model(), []
    model.register_forward_hook(lambda *_: compiling.append(torch.compiler.is_compiling()))
    x = torch.randn(2, 16)
    with Trainer(model, blocks.loss_fn, blocks.train_data, dtype="bfloat16", compile="aot_eager",
                 handle_signals=False) as trainer:
        model(x)                                    # compiled in place: its hooks are traced
        with transforms.eager():
            model(x)
        assert trainer.transforms == ["compile"]
    model(x)
    assert compiling == [True, False, False]


def test_evaluation_of_a_compiled_model_runs_its_own_eager_forward(blocks):
    model, seen = blocks.build_model(), []
    model.register_forward_hook(lambda m, *_: seen.append((m.training, torch.compiler.is_compiling())))
    eval_data = lambda: list(blocks.train_data())[:2]      # noqa: E731
    with Trainer(model, blocks.loss_fn, blocks.train_data, dtype="bfloat16", compile="aot_eager", eval_every=2,
                 eval_data=eval_data, trace_every=100, handle_signals=False) as trainer:
        trainer.fit(steps=2)
    evaluated = [compiling for training, compiling in seen if not training]
    assert len(evaluated) == 4 and not any(evaluated)     # 2 batches, under autocast and in FP32: all eager
    assert (True, True) in seen                            # step 2 trained compiled


def _fsdp_run(blocks, plan: bool = False, **kwargs) -> tuple[list[str], list[float], dict[str, torch.Tensor]]:
    model = blocks.build_model()
    if plan:
        transforms.apply_plan(model, _plan(model), device="cpu")
    with Trainer(model, blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer, dtype="bfloat16",
                 fsdp=True, clip_norm=1.0, handle_signals=False, **kwargs) as trainer:
        result = trainer.fit(steps=3)
        return trainer.transforms, result.losses, trainer.full_state_dict()


@pytest.mark.slow     # four sharded runs
@pytest.mark.parametrize("plan", [False, True], ids=["bf16", "plan"])
def test_checkpointing_blocks_under_fsdp_ends_with_the_weights_of_no_checkpointing(blocks, plan):
    # By class name: checkpointed after the shard, "Block" was no longer a class of the model (FSDP renames it).
    if plan:
        pytest.importorskip("torchao")
    _, losses, plain = _fsdp_run(blocks, plan)
    applied, checkpointed_losses, checkpointed = _fsdp_run(blocks, plan, checkpoint_activations="Block")
    assert applied == ["plan"] * plan + ["activation_checkpointing", "data_parallel"]
    assert checkpointed_losses == losses and len(losses) == 3
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name
