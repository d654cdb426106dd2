"""Zero configuration across model families we did not write: what the Monitor measures with no spec.

    OMP_NUM_THREADS=2 .venv/bin/python -m evaluation.sweep                    # every HF text type below
    OMP_NUM_THREADS=2 .venv/bin/python -m evaluation.sweep --hf llama codegen longformer
    OMP_NUM_THREADS=2 .venv-timm/bin/python -m evaluation.sweep --timm maxvit_tiny_tf_224 xcit_nano_12_p16_224

Each model is built from its library's own config with small sizes (nothing downloaded), trained for one
step in train mode with ``Monitor(model, every=1, sinks=[MemorySink()])`` and nothing else, with the
library's eager attention and, where it has one, its SDPA attention. One markdown row per model and
attention implementation: the attention layers found, how many got spectra (``qk_sigma1``) and attention
statistics (``attn_entropy``), how many were refused (every metric dropped: the head split could not be
trusted), what the layout check compared (``q,k``: the kernel's q and k against the module input
projected with the layout; ``shapes``: only shapes), and the Monitor's first warnings. A build or forward
that fails without the Monitor is the config's problem, not the Monitor's, and is listed as such. Counts
only: exactness against the full SVD and eager attention is what the test suite checks, family by family
(docs/layouts.md lists where).
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch

from diag.outputs.sinks import MemorySink
from hooks import Monitor

HF_TEXT = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo", "olmo2", "gpt_neox",
           "gptj", "codegen", "falcon", "bloom", "mpt", "gpt_bigcode", "opt", "stablelm", "starcoder2", "cohere",
           "granite", "mixtral", "persimmon", "nemotron", "glm", "helium", "smollm3", "bert", "roberta",
           "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta", "mpnet", "big_bird",
           "longformer", "t5", "bart", "mbart", "pegasus", "marian", "m2m_100", "led", "xglm", "biogpt", "ctrl")
V, E, NH = 64, 32, 4
SMALL = {"vocab_size": V, "hidden_size": E, "num_attention_heads": NH, "num_hidden_layers": 2,
         "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0}
# the same sizes under the other names configs use (set only where the config has the attribute)
ALIASES = {"n_embd": E, "n_head": NH, "n_layer": 2, "d_model": E, "num_heads": NH, "num_layers": 2, "n_heads": NH,
           "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": NH,
           "decoder_attention_heads": NH, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "n_positions": 64,
           "d_kv": E // NH, "d_ff": 64, "num_decoder_layers": 2, "num_key_value_heads": 2, "rotary_dim": 4,
           "attention_window": 4, "expansion_ratio": 2, "max_seq_len": 64}


def hf_model(model_type: str, impl: str) -> tuple[torch.nn.Module, dict]:
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **SMALL)
    for name, value in ALIASES.items():
        if hasattr(cfg, name):
            with contextlib.suppress(AttributeError):  # a read-only alias of a field set above
                setattr(cfg, name, value)
    if getattr(cfg, "head_dim", None) not in (None, E // NH):
        cfg.head_dim = E // NH
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=impl)
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(cfg, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids
    return model, batch


def timm_model(name: str, impl: str) -> tuple[torch.nn.Module, dict]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    for module in model.modules():  # timm's switch between SDPA and an explicit softmax
        if hasattr(module, "fused_attn"):
            module.fused_attn = impl == "sdpa"
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    return model, {"x": torch.randn(1, *size, generator=torch.Generator().manual_seed(1))}


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    return hidden if hidden is not None else out[0]


def row(build, name: str, impl: str) -> str:
    try:
        model, batch = build(name, impl)
        model.train()
        first_tensor(model(**batch))  # the model's own forward, without the Monitor
    except Exception as err:  # noqa: BLE001 - a config this script cannot size: not the Monitor's
        if "does not support an attention implementation" in str(err):
            return f"| {name} | {impl} | (the library has no {impl} attention for it) | | | | |"
        return f"| {name} | {impl} | not built or no forward without the Monitor: {type(err).__name__} | | | | |"
    sink = MemorySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            monitor = Monitor(model, every=1, sinks=[sink], images=False)
        except Exception as err:  # noqa: BLE001 - the Monitor refuses the model: that is the row
            return f"| {name} | {impl} | 0 | | | | refused at attach: {str(err)[:120]} |"
        first_tensor(model(**batch)).float().pow(2).mean().backward()
        checked = sorted(set(monitor.capture.checked.values()))
        monitor.step(0, loss=1.0)
        monitor.close()
    scalars = sink.records[0].scalars if sink.records else {}
    spectra = len({t.split("/")[1] for t in scalars if t.startswith("qk_sigma1/")})
    attention = len({t.split("/")[1] for t in scalars if t.startswith("attn_entropy/")})
    said = sorted({str(w.message)[:110] for w in caught if str(w.message).startswith("diag")})
    return (f"| {name} | {impl} | {len(monitor.layers)} | {spectra} | {attention} | {len(monitor.refused)} | "
            f"{', '.join(checked) or '-'}{'; ' + said[0] if said else ''} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", nargs="*", help=f"Hugging Face model types (default: {len(HF_TEXT)} text types)")
    parser.add_argument("--timm", nargs="*", help="timm model names (needs timm: .venv-timm)")
    args = parser.parse_args()
    jobs = [(timm_model, n) for n in args.timm or ()]
    if args.hf is not None or not jobs:
        jobs = [(hf_model, n) for n in (args.hf or HF_TEXT)] + jobs
    print("| model | attention | layers | with spectra | with attention statistics | refused | checked; first "
          "warning |")
    print("|---|---|---|---|---|---|---|")
    for build, name in jobs:
        for impl in ("eager", "sdpa"):
            print(row(build, name, impl), flush=True)


if __name__ == "__main__":
    main()
