"""No code from a checkpoint or a config is ever run; the package touches the network only through the outputs a
user turns on (a webhook URL, a W&B or MLflow sink).

* A static scan (``ast``) of every module of ``diag`` and ``hooks``: no ``eval``/``exec``/
  ``compile``/``__import__`` calls, no ``pickle``/``dill`` loading, every ``torch.load``
  with ``weights_only=True``, no ``trust_remote_code`` other than ``False``, and no
  import of a network library (``wandb`` and ``mlflow`` included) outside the modules of those outputs.
* A Hugging Face folder whose ``config.json`` and ``tokenizer_config.json`` point at
  code beside them (``auto_map``, ``trust_remote_code``) is analysed, with and without
  ``--probe`` (which builds a model from the config): none of that code is imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("diag", "hooks")
NETWORK_MODULES = {
    "socket",
    "urllib",
    "urllib2",
    "urllib3",
    "http",
    "requests",
    "httpx",
    "aiohttp",
    "ftplib",
    "smtplib",
    "xmlrpc",
    "websocket",
    "websockets",
    "telnetlib",
    "paramiko",
    "wandb",
    "mlflow",
}
# The outputs that send what the user asked them to send, where the user asked (each built only on request): the
# alert webhook's URL, the W&B run, the MLflow tracking server. Their imports of network libraries are allowed.
SENDING_OUTPUTS = {"diag/outputs/webhook.py", "diag/outputs/wandb_sink.py", "diag/outputs/mlflow_sink.py"}
CODE_RUNNERS = {"eval", "exec", "compile", "__import__", "execfile", "runpy"}
# The one module allowed to import code by name: ``analyze --model MODULE:CALLABLE`` runs the user's own code,
# named by the user on the command line (never a name read from a checkpoint or a config).
USER_CODE = {"hooks/checkpoint/usermodel.py"}
MODULE_LOADERS = {"importlib.import_module", "import_module", "importlib.__import__", "spec_from_file_location",
                  "importlib.util.spec_from_file_location", "exec_module"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def _sources() -> list[Path]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 10
    return files


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []

    def where(node: ast.AST) -> str:
        return f"{path.relative_to(ROOT)}:{node.lineno}"

    network = set() if str(path.relative_to(ROOT)) in SENDING_OUTPUTS else NETWORK_MODULES

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in network or top in {"runpy", "code", "codeop"}:
                    found.append(f"{where(node)} imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0]
            if top in network or top in {"runpy", "code", "codeop"}:
                found.append(f"{where(node)} imports from {node.module}")
            if top in PICKLE_MODULES and any(a.name in {"load", "loads", "Unpickler"} for a in node.names):
                found.append(f"{where(node)} imports a pickle loader from {node.module}")
            if top == "builtins" and any(a.name in CODE_RUNNERS for a in node.names):
                found.append(f"{where(node)} imports a code runner from builtins")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in CODE_RUNNERS or name in {f"builtins.{n}" for n in CODE_RUNNERS}:
                found.append(f"{where(node)} calls {name}")
            if name.split(".")[0] in PICKLE_MODULES and last in {"load", "loads", "Unpickler"}:
                found.append(f"{where(node)} calls {name}")
            if (name in MODULE_LOADERS or last in {"exec_module", "spec_from_file_location"}) and str(
                    path.relative_to(ROOT)) not in USER_CODE:
                found.append(f"{where(node)} imports a module by name")
            if name.endswith("torch.load"):
                ok = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not ok:
                    found.append(f"{where(node)} calls torch.load without weights_only=True")
            for k in node.keywords:
                if k.arg == "trust_remote_code" and not (isinstance(k.value, ast.Constant) and k.value.value is False):
                    found.append(f"{where(node)} passes trust_remote_code other than False")
                # **kwargs could smuggle trust_remote_code into a from_pretrained
                if (
                    k.arg is None
                    and last in {"from_pretrained", "for_model", "from_dict"}
                    and not _kwargs_from_config(node)
                ):
                    found.append(f"{where(node)} passes **kwargs to {name}")
        elif isinstance(node, ast.Name) and node.id in {"eval", "exec"} and isinstance(node.ctx, ast.Load):
            found.append(f"{where(node)} refers to {node.id}")
    return found


def _kwargs_from_config(node: ast.Call) -> bool:
    """``AutoConfig.for_model(model_type, **config)`` in hooks/checkpoint/probe.py: the config dict's values become
    attributes; auto_map / trust_remote_code entries there are inert (the behaviour test below checks)."""
    return _dotted(node.func).endswith("for_model")


def test_the_scan_sees_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle, socket\nfrom urllib.request import urlopen\nimport torch\n"
        "x = eval('1')\nexec('y = 2')\npickle.loads(b'')\ntorch.load('f')\ntorch.load('f', weights_only=False)\n"
        "AutoModel.from_pretrained('x', trust_remote_code=True)\n"
        "importlib.import_module('m')\nspec.loader.exec_module(m)\n"
    )
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = _problems(bad)
    finally:
        ROOT = root
    text = "\n".join(found)
    for needle in (
        "imports socket",
        "imports from urllib.request",
        "calls eval",
        "calls exec",
        "calls pickle.loads",
        "bad.py:7 calls torch.load",
        "bad.py:8 calls torch.load",
        "trust_remote_code",
        "bad.py:10 imports a module by name",
        "bad.py:11 imports a module by name",
    ):
        assert needle in text, (needle, found)


def test_package_source_runs_no_code_and_opens_no_network():
    problems = [p for path in _sources() for p in _problems(path)]
    assert problems == []
    assert all((ROOT / name).is_file() for name in SENDING_OUTPUTS)
    # the scan did see the package's torch.load calls (all with weights_only=True, or it would have said so)
    calls = [
        n
        for path in _sources()
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(n, ast.Call) and _dotted(n.func) == "torch.load"
    ]
    assert len(calls) >= 2


# ---------------------------------------------------------------- a folder with code in it

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported " + __name__)
raise SystemExit("code from the checkpoint folder ran")
"""


def _evil_folder(tmp_path: Path) -> tuple[Path, Path]:
    import torch

    from tests.support import zoo

    marker = tmp_path / "MARKER"
    case = zoo.gpt2(dropout=0.0)
    folder = tmp_path / "checkpoint-3"
    case.model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        {
            "auto_map": {
                "AutoConfig": "configuration_evil.EvilConfig",
                "AutoModel": "modeling_evil.EvilModel",
                "AutoModelForCausalLM": "modeling_evil.EvilModel",
                "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
            },
            "trust_remote_code": True,
            "custom_pipelines": {"text-generation": {"impl": "modeling_evil.Pipe"}},
        }
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
                "tokenizer_class": "EvilTokenizer",
                "trust_remote_code": True,
            }
        )
    )
    for name in ("configuration_evil", "modeling_evil", "tokenization_evil", "evil", "__init__"):
        (folder / f"{name}.py").write_text(EVIL.format(marker=str(marker)))
    (tmp_path / "ids.txt").write_text(" ".join(map(str, torch.arange(1, 9).tolist())) + "\n")
    (tmp_path / "text.txt").write_text("some words to tokenize\n")
    return folder, marker


@pytest.mark.parametrize("probe", [None, "ids.txt", "text.txt"], ids=["weights", "probe-ids", "probe-text"])
def test_code_beside_a_checkpoint_is_never_imported(probe, tmp_path):
    folder, marker = _evil_folder(tmp_path)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),
        PYTHONPATH=str(ROOT),
    )
    cmd = [
        sys.executable,
        "-m",
        "diag",
        "analyze",
        str(folder),
        "--out",
        str(tmp_path / "out"),
        "--quiet",
        "--no-report",
        "--json",
    ]
    if probe:
        cmd += ["--probe", str(tmp_path / probe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    assert not marker.exists(), marker.read_text()
    assert "code from the checkpoint folder ran" not in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "hf-home").rglob("*evil*"))  # not copied into transformers' module cache
    summary = json.loads(proc.stdout)
    assert summary["checkpoints"] and summary["checkpoints"][0]["step"] == 3  # the weights were analysed
    if probe == "ids.txt":
        assert proc.returncode == 0, proc.stderr  # the built-in GPT-2 class, built from the config alone
        assert "attn_entropy" in json.dumps(summary["metrics"])
    else:
        assert proc.returncode in (0, 1), proc.stderr
