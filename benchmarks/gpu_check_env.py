"""What ``benchmarks/gpu_check.py`` records of where it ran: the commit, and (run as a child, so the parent imports no
torch) the device, driver and versions.

    PYTHONPATH=. python3 benchmarks/gpu_check_env.py cuda   # prints the device part's JSON
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def head_from_files(git: Path) -> str | None:
    """The commit ``HEAD`` names, read from a ``.git`` folder (or a worktree's ``.git`` file) without git."""
    if git.is_file():
        text = git.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git = (git.parent / text.removeprefix("gitdir:").strip()).resolve()
    if not (git / "HEAD").is_file():
        return None
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head or None  # a detached HEAD holds the commit itself
    ref = head.removeprefix("ref:").strip()
    folders = [git]
    if (git / "commondir").is_file():
        folders.append((git / (git / "commondir").read_text().strip()).resolve())
    for folder in folders:
        if (folder / ref).is_file():
            return (folder / ref).read_text().strip()
        packed = folder / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(f" {ref}"):
                    return line.split()[0]
    return None


def commit(given: str | None) -> dict:
    if given:
        return {"sha": given, "source": "--commit", "dirty": None}
    if shutil.which("git"):
        try:
            sha = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
            top, _, head = sha.stdout.strip().partition("\n")
            if sha.returncode == 0 and Path(top).resolve() == ROOT:  # this checkout, not a repository around it
                status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                        capture_output=True, text=True, timeout=30)
                dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
                return {"sha": head.strip(), "source": "git rev-parse HEAD", "dirty": dirty}
        except (OSError, subprocess.TimeoutExpired):
            pass
    sha = head_from_files(ROOT / ".git")
    source = ".git read by hand" if sha else "unknown: not a git checkout and no .git (pass --commit SHA)"
    return {"sha": sha, "source": source, "dirty": None}


def device_info(device: str) -> dict:
    from importlib import metadata

    import torch

    import diag

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "numpy": version("numpy"), "cpus": os.cpu_count(),
            "diag_from": str(Path(diag.__file__).resolve().parent), "device": device, "cuda_available": False}
    if torch.cuda.is_available() and device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(cuda_available=True, name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version(), driver=driver())
    else:
        info.update(name="CPU", cuda_available=torch.cuda.is_available())
    return info


def driver() -> str | None:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc = Path("/proc/driver/nvidia/version")
    return proc.read_text().splitlines()[0].strip() if proc.is_file() else None


if __name__ == "__main__":
    print(json.dumps(device_info(sys.argv[1] if len(sys.argv) > 1 else "cuda")))
