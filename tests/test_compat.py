"""``ctxext.compat``: every private reach into another library works on the installed versions (on tiny models built
from configs), and no module outside ``ctxext/compat/`` names a gathered private name, so a new scattered reach
fails here (issue 26). The CI matrix (``.ci/matrix``) runs this file on every supported transformers release."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_bloom, tiny_llama
from test_eval_fixtures import save_tiny_llama

import ctxext
from ctxext.compat import lm_eval as lm_eval_compat
from ctxext.compat import torch as torch_compat
from ctxext.compat import transformers as hf_compat
from ctxext.methods.alibi import alibi_slopes

PACKAGE = Path(ctxext.__file__).parent
COMPAT = PACKAGE / "compat"

# -- transformers: the attention implementation --------------------------------------------------------------------


def test_attention_implementation_is_read_switched_and_restored_exactly():
    model = tiny_llama()
    config = model.config
    assert hf_compat.attn_implementation(config) == config._attn_implementation
    stored = hf_compat.stored_attn_implementation(config)
    assert stored is config._attn_implementation_internal

    model.set_attn_implementation("eager")
    assert hf_compat.attn_implementation(config) == "eager"
    assert hf_compat.stored_attn_implementation(config) == "eager"
    hf_compat.restore_attn_implementation(config, stored)
    assert config._attn_implementation_internal is stored  # the raw value, not a resolved default


def test_a_config_set_before_the_model_is_built_selects_its_attention():
    from transformers import LlamaForCausalLM

    config = tiny_llama().config
    hf_compat.set_attn_implementation(config, "eager")
    assert hf_compat.attn_implementation(LlamaForCausalLM(config).config) == "eager"


def test_can_set_attn_implementation_tells_models_from_other_modules():
    assert hf_compat.can_set_attn_implementation(tiny_llama()) is True
    assert hf_compat.can_set_attn_implementation(tiny_bloom()) is False  # BLOOM computes its own attention
    assert hf_compat.can_set_attn_implementation(torch.nn.Linear(2, 2)) is None


def test_sdpa_attention_is_transformers_own_and_followed_when_replaced(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    assert hf_compat.sdpa_attention() is sdpa.sdpa_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = hf_compat.sdpa_attention()(module, q, k, v, None, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want)
    assert weights is None

    def replaced(*args, **kwargs):
        return "replaced"

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", replaced)
    assert hf_compat.sdpa_attention() is replaced


def test_model_attention_function_is_what_the_layer_calls():
    from transformers.models.llama import modeling_llama

    layer = next(m for m in tiny_llama().modules() if isinstance(m, modeling_llama.LlamaAttention))
    assert hf_compat.model_attention_function(layer, "eager") is modeling_llama.eager_attention_forward
    assert hf_compat.model_attention_function(layer, "sdpa") is modeling_llama.ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert hf_compat.model_attention_function(layer, "no-such-attention") is None
    assert hf_compat.model_attention_function(torch.nn.Linear(2, 2), "eager") is None


# -- transformers: the ALiBi builders ------------------------------------------------------------------------------


def test_bloom_slope_function_or_tensor_builder_gives_bloom_slopes():
    from transformers.models.bloom import modeling_bloom

    model = tiny_bloom()
    builder = hf_compat.alibi_tensor_builder(model.transformer)
    assert builder is not None and hf_compat.alibi_tensor_builder(model) is None
    heads = model.config.n_head
    from_tensor = builder(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
    assert torch.equal(from_tensor, alibi_slopes(heads))
    slope_function = hf_compat.bloom_slope_function(modeling_bloom)
    # present in some releases only (5.23.0 has it, 5.0.0 - 5.18.0 do not): where present it is the hook point
    assert slope_function is getattr(modeling_bloom, "_get_alibi_slopes", None)
    if slope_function is not None:
        assert torch.equal(slope_function(heads, torch.device("cpu")), alibi_slopes(heads))


def test_wrap_instance_builder_wraps_one_instance_and_undoes():
    model, other = tiny_bloom(), tiny_bloom()
    owner = model.transformer
    calls = []

    def make(original):
        def wrapped(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)
        return wrapped

    undo = hf_compat.wrap_instance_builder(owner, hf_compat.ALIBI_TENSOR_BUILDER, make)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)  # with a mask, every release builds the tensor through the method
    with torch.no_grad():
        model(ids, attention_mask=mask)
        other(ids, attention_mask=mask)
    assert len(calls) == 1  # the patched instance only
    undo()
    assert hf_compat.ALIBI_TENSOR_BUILDER not in vars(owner)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert len(calls) == 1


def test_falcon_and_mpt_builders_are_found():
    from transformers import FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM
    from transformers.models.falcon import modeling_falcon

    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, alibi=True))
    assert hf_compat.alibi_tensor_builder(modeling_falcon) is modeling_falcon.build_alibi_tensor
    assert any(getattr(m, "use_alibi", None) is True for m in falcon.modules())
    mpt = MptForCausalLM(MptConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, max_seq_len=32))
    builder = hf_compat.mpt_alibi_tensor_builder(mpt.transformer)
    assert builder is not None and hf_compat.mpt_alibi_tensor_builder(mpt) is None
    assert builder(2, 32).shape[-1] == 32


# -- torch ---------------------------------------------------------------------------------------------------------


def test_cpu_flash_attention_returns_output_and_log_sum_exp():
    assert torch_compat.cpu_flash_attention_tested() == (
        ".".join(torch.__version__.split("+")[0].split(".")[:2]) in torch_compat.CPU_FLASH_TESTED)
    op = torch_compat.cpu_flash_attention()
    if op is None:
        pytest.skip("this torch has no CPU flash op")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    out, lse = op(q, k, v, 0.0, True, scale=0.5)[:2]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.reshape(1, 2, 5), scores.logsumexp(-1))


def test_recompile_limit_is_raised_inside_the_block_only_and_never_lowered(monkeypatch):
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    with torch_compat.raised_recompile_limit(64):
        assert dynamo_config.recompile_limit == 64
    assert dynamo_config.recompile_limit == 8  # the process's own setting, untouched after the block
    with torch_compat.raised_recompile_limit(4):
        assert dynamo_config.recompile_limit == 8  # never lowered
    with pytest.raises(RuntimeError):
        with torch_compat.raised_recompile_limit(64):
            raise RuntimeError("a failing compiled call")
    assert dynamo_config.recompile_limit == 8  # restored on an error too


# -- lm-eval -------------------------------------------------------------------------------------------------------


def test_hflm_has_the_hooks_ctxext_overrides():
    from lm_eval.models.huggingface import HFLM

    lm_eval_compat.check_hflm_hooks(HFLM)

    class Renamed:
        pass

    with pytest.raises(OSError, match=r"no _get_config, _create_model.*tested with lm-eval 0\.4\.13"):
        lm_eval_compat.check_hflm_hooks(Renamed)


def test_hflm_state_is_read_and_replaced(tmp_path):
    from lm_eval.models.huggingface import HFLM

    model_dir = save_tiny_llama(tmp_path / "llama")
    lm = HFLM(pretrained=str(model_dir), device="cpu", max_length=48)
    model = lm_eval_compat.loaded_model(lm)
    assert model is lm.model and isinstance(model, torch.nn.Module)
    assert lm_eval_compat.max_length_argument(lm) == 48 == lm.max_length
    assert not lm_eval_compat.max_length_argument(HFLM(pretrained=str(model_dir), device="cpu"))
    other = tiny_llama()
    lm_eval_compat.replace_model(lm, other)
    assert lm.model is other
    lm_eval_compat.set_config(lm, other.config)
    assert lm.config is other.config


def test_lm_eval_command_line_pieces():
    assert callable(lm_eval_compat.harness_cli())
    assert lm_eval_compat.model_args_splitter()("a=1,b=[1,2],c='x,y'") == ["a=1", "b=[1,2]", "c='x,y'"]
    index, log = lm_eval_compat.task_index()
    assert isinstance(index.__dict__.get("build"), staticmethod) and hasattr(log, "warning")


# -- no scattered reach --------------------------------------------------------------------------------------------

#: Private names of other libraries that only ``ctxext/compat/`` may name (as an attribute, a name, an imported
#: name, or a string constant that is exactly the name; docstrings and comments may mention them).
GATHERED = {
    "_attn_implementation", "_attn_implementation_internal", "_can_set_attn_implementation",
    hf_compat.BLOOM_SLOPE_FUNCTION, hf_compat.ALIBI_TENSOR_BUILDER, hf_compat.MPT_ALIBI_TENSOR_BUILDER,
    "sdpa_attention_forward", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward",
    "_max_length", "_get_config", "_create_model",
    torch_compat.CPU_FLASH_OP, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "recompile_limit", "cache_size_limit",
}
#: HFLM's private state, which only the lm-eval integration touches, through ``ctxext.compat.lm_eval``.
HFLM_STATE = {"_model", "_config"}
#: Libraries whose private (underscore) modules only ``ctxext/compat/`` imports.
LIBRARIES = ("transformers", "lm_eval", "accelerate", "peft", "torch")
#: Internal modules without an underscore that only ``ctxext/compat/`` imports.
INTERNAL_MODULES = ("transformers.integrations.sdpa_attention",)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (or other bare string statements)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private_module(name: str) -> bool:
    if name in INTERNAL_MODULES:
        return True
    parts = name.split(".")
    return parts[0] in LIBRARIES and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def reaches(source: str, banned=frozenset(GATHERED)) -> list[str]:
    """Where ``source`` names a gathered private name or imports a private module of another library.
    ``HFLM_HOOKS`` may be overridden (``def``) and called on ``super()``: that is how a subclass overrides them, and
    ``ctxext.compat.lm_eval.check_hflm_hooks`` refuses an lm-eval that lacks them."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in banned:
            if not (node.attr in lm_eval_compat.HFLM_HOOKS and _is_super_call(node.value)):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in banned:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Constant) and node.value in banned and id(node) not in docstrings:
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            for alias in node.names:
                if alias.name in banned or _private_module(f"{module}.{alias.name}") or _private_module(module):
                    found.append(f"line {node.lineno}: from {module} import {alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if _private_module(a.name)]
    return found


def test_the_check_finds_a_scattered_reach():
    assert reaches("config._attn_implementation_internal = 'x'") == ["line 1: ._attn_implementation_internal"]
    assert reaches("getattr(m, '_get_alibi_slopes', None)") == ["line 1: '_get_alibi_slopes'"]
    assert reaches("from transformers.integrations.sdpa_attention import sdpa_attention_forward")
    assert reaches("import torch._dynamo.config as c") == ["line 1: import torch._dynamo.config"]
    assert reaches("import transformers.integrations.sdpa_attention as sdpa")
    assert reaches("from transformers.integrations import sdpa_attention")
    assert reaches("from lm_eval.tasks._index import TaskIndex") == [
        "line 1: from lm_eval.tasks._index import TaskIndex"]
    assert reaches("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q)")
    assert reaches("lm._max_length")
    assert reaches('"""Docstrings may say _get_alibi_slopes."""\nx = 1  # and comments build_alibi_tensor') == []
    assert reaches("class L(HFLM):\n    def _get_config(self):\n        return super()._get_config()") == []
    assert reaches("self._get_config()")


def test_no_private_reach_outside_compat():
    scattered = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        source = path.read_text(encoding="utf-8")
        banned = GATHERED | HFLM_STATE if relative == "integrations/lm_eval.py" else GATHERED
        found = reaches(source, frozenset(banned))
        if found:
            scattered[relative] = found
    assert not scattered, f"private reaches outside ctxext/compat/ (gather them there): {scattered}"


def test_compat_imports_nothing_from_ctxext_above_it():
    for path in COMPAT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = (node.module or "").split(".")[0]
                assert node.level == 2 and target == "core", f"{path.name} imports .{'.' * (node.level - 1)}{target}"
            elif isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any((n or "").startswith("ctxext") for n in names), path.name
