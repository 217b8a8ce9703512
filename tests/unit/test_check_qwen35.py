"""`vllm-hidden check` on a Qwen3.5/3.6 checkpoint as released: `Qwen3_5ForConditionalGeneration`,
a composite config (text + vision), here at width 256 with 4 layers (3 Gated DeltaNet, 1 gated
attention). Both references, with HF Transformers' other class for the checkpoint
(Qwen3_5ForConditionalGeneration, tests/gpu/reference.py) standing in for the engine: right
weights pass, other weights fail. Also the FP8 checkpoint's config (quantization_config on the
composite), the config class vLLM 0.26 registers for qwen3_5 once its engine has read such a
checkpoint in the same process, and which kernels run the Gated-DeltaNet layers."""

from __future__ import annotations

import functools
import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from tests.gpu.reference import Qwen35Reference
from tests.outputs import write_output
from vllm_hidden.check import against_engine, check_output, gdn
from vllm_hidden.check.head import Head
from vllm_hidden.check.reference import FINAL, Reference
from vllm_hidden.cli import app
from vllm_hidden.demo import QWEN35_TINY_WIDTHS, make_qwen35_model, write_fp8_checkpoint
from vllm_hidden.engine import logprobs as engine_logprobs

NUM_LAYERS = 4
VOCAB = 1024
H = QWEN35_TINY_WIDTHS["hidden_size"]
PROMPTS = {f"s{i}": [(11 * i + 7 * t) % (VOCAB - 10) + 10 for t in range(17 + 23 * i)] for i in range(3)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    a = make_qwen35_model(root / "a", num_layers=NUM_LAYERS, vocab_size=VOCAB, widths=QWEN35_TINY_WIDTHS)
    return {"a": a, "b": make_qwen35_model(root / "b", num_layers=NUM_LAYERS, vocab_size=VOCAB, seed=1,
                                           widths=QWEN35_TINY_WIDTHS),
            "a-fp8": write_fp8_checkpoint(a, root / "a-fp8")}


def _engine_logprobs(model, k: int = 5) -> dict:
    """{sample id: prompt logprobs as vLLM reports them} from `model` in float32: position t >= 1
    holds the top k and the prompt's own token, predicted from row t - 1."""
    ref = Qwen35Reference(model, device="cpu")
    out = {}
    for sid, ids in PROMPTS.items():
        r, _ = ref.run(ids)
        lp = torch.log_softmax(r.logits[0].float(), dim=-1)
        out[sid] = [None] + [{tok: lp[t - 1, tok].item() for tok in {*torch.topk(lp[t - 1], k).indices.tolist(),
                                                                     ids[t]}} for t in range(1, len(ids))]
    return out


@pytest.fixture(scope="module")
def outputs(models, tmp_path_factory):
    """Outputs of model a's states, written without an engine: `hf` every layer and the final
    state, from HF in bfloat16 (as an engine computes them); `engine` the last layer and the final
    state of HF float32, rounded to bfloat16. Plus the logprobs each model's engine would report."""
    root = tmp_path_factory.mktemp("qwen35-out")
    ref = Qwen35Reference(models["a"], device="cpu")
    eng = {}
    for sid, ids in PROMPTS.items():
        r, states = ref.run(ids)
        eng[sid] = (torch.tensor(ids), states[NUM_LAYERS].to(torch.bfloat16)[:, None],
                    r.hidden_states[-1][0].to(torch.bfloat16))
    ref.model.to(torch.bfloat16)
    hf = {}
    for sid, ids in PROMPTS.items():
        r, states = ref.run(ids)
        hf[sid] = (torch.tensor(ids), torch.stack(states[1:], 1).to(torch.bfloat16), r.hidden_states[-1][0].bfloat16())
    del ref
    fields = {"model": str(models["a"]), "num_model_layers": NUM_LAYERS, "final_state": "post-norm"}
    write_output(root / "hf", list(range(NUM_LAYERS)), H, hf, final_state=True, manifest=fields)
    write_output(root / "engine", [NUM_LAYERS - 1], H, eng, final_state=True, manifest=fields)
    return {"hf": root / "hf", "engine": root / "engine",
            "logprobs": {m: _engine_logprobs(models[m]) for m in ("a", "b")}}


@pytest.fixture
def vllm_registered(monkeypatch):
    """AutoConfig as vLLM 0.26 leaves it after its engine read a qwen3_5 checkpoint in this
    process: its own Qwen3_5Config (a text sub-config Transformers' model classes do not know)
    registered for the model type (vllm/transformers_utils/config.py, _register_config_class)."""
    from transformers import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = type("Qwen3_5TextConfig", (Qwen3_5TextConfig,), {})
    top = type("Qwen3_5Config", (Qwen3_5Config,), {"sub_configs": {**Qwen3_5Config.sub_configs,
                                                                    "text_config": text}})

    def register():
        monkeypatch.setitem(CONFIG_MAPPING._extra_content, "qwen3_5", top)

    return register


# -- --reference hf ------------------------------------------------------------------------------

def test_reference_hf_passes_the_right_weights(models, outputs, vllm_registered):
    vllm_registered()  # the checkpoint must be read as Transformers reads it, whatever is registered
    r = check_output(str(outputs["hf"]), str(models["a"]), samples=3)
    assert r.verdict == "pass" and r.gdn_kernels == "torch", r.table()
    assert list(r.layers) == list(range(NUM_LAYERS)) and r.final_state is not None
    for c in [*r.layers.values(), r.final_state]:
        # the stand-in engine is HF's other class for the checkpoint in bf16: HF's own rounding error
        assert c.rel_l2 == pytest.approx(c.hf_rounding, rel=1e-3) and 1e-4 < c.rel_l2 < 0.05 and c.neighbour_ok
    assert r.to_dict()["gdn_kernels"] == "torch" and "Gated-DeltaNet kernels: torch" in r.message()


def test_reference_hf_fails_other_weights(models, outputs):
    r = check_output(str(outputs["hf"]), str(models["b"]), samples=2)
    assert r.verdict == "fail", r.table()
    assert all(c.rel_l2 > 0.1 and not c.ok for c in r.layers.values()), r.table()


# -- --reference engine --------------------------------------------------------------------------

def _fake_engine(monkeypatch, logprobs: dict, register) -> None:
    """prompt_logprobs answered from `logprobs`; like the real engine it leaves vLLM's
    qwen3_5 config class registered in this process."""
    by_tokens = {tuple(PROMPTS[sid]): lp for sid, lp in logprobs.items()}

    def fake(model_arg, cli_args, token_lists, k):
        register()
        runs = [by_tokens[tuple(ids)] for ids in token_lists]
        return runs, runs

    monkeypatch.setattr(engine_logprobs, "prompt_logprobs", fake)


@pytest.mark.parametrize("ckpt", ["a", "a-fp8"])
def test_reference_engine_passes_the_engines_own_logprobs(models, outputs, monkeypatch, vllm_registered, ckpt):
    """`a-fp8`: tests/gpu/test_gpu_fp8.py's FP8 checkpoint (quantization_config on the composite
    config; the norm and LM head stored unquantized, so they are a's)."""
    _fake_engine(monkeypatch, outputs["logprobs"]["a"], vllm_registered)
    r = against_engine.check_against_engine(str(outputs["engine"]), str(models[ckpt]), samples=3, top_k=5)
    assert r.ok and [s.name for s in r.sources] == ["last layer", "final state"], r.table()
    assert r.positions == sum(len(p) - 1 for p in PROMPTS.values())
    for s in r.sources:
        assert s.mean_abs < s.bound / 2 and s.top1_agree > 0.9, r.table()


def test_reference_engine_fails_other_weights(models, outputs, monkeypatch, vllm_registered):
    _fake_engine(monkeypatch, outputs["logprobs"]["b"], vllm_registered)
    r = against_engine.check_against_engine(str(outputs["engine"]), str(models["a"]), samples=3, top_k=5)
    assert not r.ok and all(s.mean_abs > 20 * s.bound for s in r.sources), r.table()


def test_the_head_of_the_composite_checkpoint_is_hfs(models):
    """Our norm + LM head on HF's last pre-norm state give HF's own logits (Qwen3.5's norm
    scales by 1 + w), for the bf16 checkpoint and the FP8 one alike."""
    ref = Qwen35Reference(models["a"], device="cpu")
    ids = PROMPTS["s1"]
    r, states = ref.run(ids)
    want = torch.log_softmax(r.logits[0].float(), dim=-1)
    rows = torch.arange(len(ids)).repeat_interleave(3)
    cols = torch.tensor([5, 17, 901] * len(ids))
    for ckpt in ("a", "a-fp8"):
        got = Head(str(models[ckpt])).logprobs(states[NUM_LAYERS], rows, cols, normed=False)
        assert torch.allclose(got, want[rows, cols], atol=1e-4), (ckpt, (got - want[rows, cols]).abs().max())


# -- which kernels run the Gated-DeltaNet layers -------------------------------------------------

def test_gdn_kernels_are_chosen_explicitly(monkeypatch):
    def no_fla():
        raise AssertionError("fla must not be imported for a CPU run")

    monkeypatch.setattr(gdn, "fla_ops", no_fla)
    assert gdn.choose(None, "cpu") == "torch" and gdn.choose("auto", "cpu") == "torch"
    assert gdn.choose("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="--gdn-kernels fla needs --device cuda .* got --device 'cpu'"):
        gdn.choose("fla", "cpu")
    with pytest.raises(ValueError, match="one of auto, fla, torch, got 'triton'"):
        gdn.choose("triton", "cpu")
    monkeypatch.setattr(gdn, "fla_ops", lambda: types.SimpleNamespace())
    assert gdn.choose(None, "cuda") == "fla" and gdn.choose("fla", "cuda:0") == "fla"

    def missing():
        raise ModuleNotFoundError("No module named 'fla'", name="fla")

    monkeypatch.setattr(gdn, "fla_ops", missing)
    assert gdn.choose(None, "cuda") == "torch"
    with pytest.raises(ValueError, match="--gdn-kernels fla, but flash-linear-attention cannot be used"):
        gdn.choose("fla", "cuda")


def _gdn_module():
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    return m


def test_torch_kernels_run_even_where_transformers_bound_others(models, monkeypatch):
    """Transformers binds its GDN functions to fla / causal-conv1d whenever they import, on any
    device; a CPU check must run the torch code all the same, and leave the binding as it found it."""
    mod = _gdn_module()
    ref = Reference(str(models["a"]))
    ids = PROMPTS["s2"]
    want = ref.run(ids, {0, 2, 3, FINAL})

    def triton_on_cpu(torch_function):
        @functools.wraps(torch_function)  # as transformers wraps the package's op
        def op(*a, **kw):
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

        return op

    bound = {name: triton_on_cpu(getattr(mod, name)) for name in gdn._FUNCS}
    for name, op in bound.items():
        monkeypatch.setattr(mod, name, op)
    with pytest.raises(RuntimeError, match="Triton"):
        ref.model(torch.tensor([ids]), use_cache=False)  # unpinned: the bound op runs
    got = Reference(str(models["a"]), gdn_kernels="torch").run(ids, {0, 2, 3, FINAL})
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(getattr(mod, name) is op for name, op in bound.items())


def test_fla_kernels_are_what_the_layers_call(models, monkeypatch):
    """The "fla" binding with a stand-in for fla.ops.gated_delta_rule (its signature, transformers'
    torch code inside): every GDN layer calls it, with only the arguments it names."""
    mod = _gdn_module()
    torch_chunk = gdn._torch_impl(mod, "torch_chunk_gated_delta_rule")
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        calls.append(sorted(kwargs))
        return torch_chunk(q, k, v, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def fused_recurrent_gated_delta_rule(*a, **kw):
        raise AssertionError("a forward without a cache has no recurrent step")

    monkeypatch.setattr(gdn, "fla_ops", lambda: types.SimpleNamespace(
        chunk_gated_delta_rule=chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule))
    ids = PROMPTS["s1"]
    want = Reference(str(models["a"])).run(ids, {2, FINAL})
    ref = Reference(str(models["a"]), gdn_kernels="fla")
    assert ref.gdn_kernels == "fla"
    got = ref.run(ids, {2, FINAL})
    assert len(calls) == 3 and calls == [[]] * 3  # the three GDN layers; nothing it does not name
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_model_without_gdn_layers_reports_none(tiny_models):
    assert Reference(str(tiny_models("qwen3", 4))).gdn_kernels is None


def test_older_transformers_per_layer_choice_is_refused_unless_already_torch(monkeypatch):
    """Transformers before the module-function binding chose the kernels per layer when the model
    was built: accepted only where that choice is transformers' torch code and torch is asked for."""
    old = types.ModuleType("old_modeling")

    def torch_chunk_gated_delta_rule(*a, **kw):
        return None

    class OldRMSNormGated(torch.nn.Module):
        pass

    class OldGatedDeltaNet(torch.nn.Module):
        def __init__(self, chunk, conv, norm):
            super().__init__()
            self.chunk_gated_delta_rule, self.causal_conv1d_fn, self.norm = chunk, conv, norm

    for obj in (torch_chunk_gated_delta_rule, OldRMSNormGated, OldGatedDeltaNet):
        obj.__module__ = old.__name__
        setattr(old, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, old.__name__, old)
    on_torch = torch.nn.Sequential(OldGatedDeltaNet(torch_chunk_gated_delta_rule, None, OldRMSNormGated()))
    k = gdn.GdnKernels(on_torch, "torch")
    assert k.name == "torch" and k._binds == []
    with pytest.raises(ValueError, match="chose the Gated-DeltaNet kernels of OldGatedDeltaNet .*asked for: fla"):
        gdn.GdnKernels(on_torch, "fla")
    on_fla = torch.nn.Sequential(OldGatedDeltaNet(len, None, OldRMSNormGated()))  # another chunk function
    with pytest.raises(ValueError, match="asked for: torch"):
        gdn.GdnKernels(on_fla, "torch")


# -- the command line ----------------------------------------------------------------------------

def test_cli_gdn_kernels(models, outputs):
    run = CliRunner().invoke
    r = run(app, ["check", str(outputs["hf"]), "--model", str(models["a"]), "--samples", "1", "--json",
                  "--gdn-kernels", "torch"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["gdn_kernels"] == "torch" and d["verdict"] == "pass"
    for args, says in ((["--gdn-kernels", "fla"], "--gdn-kernels fla needs --device cuda"),
                       (["--gdn-kernels", "fast"], "got 'fast'"),
                       (["--gdn-kernels", "torch", "--reference", "engine"], "--gdn-kernels goes with --reference hf")):
        r = run(app, ["check", str(outputs["hf"]), "--model", str(models["a"]), *args])
        assert r.exit_code == 2 and says in r.stderr, r.output
