"""llama.cpp's sources (convert_hf_to_gguf.py, gguf-py, the quantiser's C sources) from the
llama-cpp-python source distribution on PyPI, shared by the scripts that need them.

The sdist is fetched through PyPI's simple index (JSON form) and checked against its sha256:
`pip download --no-binary :all:` would build every build dependency of the package (cmake among
them) from source just to read its metadata. Unpacked under $KILN_SCRIPTS_CACHE (default
~/.cache/kiln-scripts).

Import it by path (the scripts keep their own folder off sys.path):

    spec = importlib.util.spec_from_file_location("llama_cpp_sources", HERE / "llama_cpp_sources.py")
"""

import hashlib
import json
import os
import pathlib
import sys
import tarfile
import urllib.request

WORK = pathlib.Path(os.environ.get("KILN_SCRIPTS_CACHE", pathlib.Path.home() / ".cache" / "kiln-scripts"))


def download_sdist(project, version, dest):
    """The path of `project==version`'s source distribution, downloaded into `dest` if needed."""
    name = project.replace("-", "_")
    want = f"{name}-{version}.tar.gz"
    out = dest / want
    if out.exists():
        return out
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    req = urllib.request.Request(f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == want), None)
    if entry is None:
        sys.exit(f"{want} is not on {index}/{project}/")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=600) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        tmp.unlink()
        sys.exit(f"{want}: sha256 mismatch")
    tmp.rename(out)
    return out


def llama_cpp_dir(version):
    """The `vendor/llama.cpp` folder of llama-cpp-python `version`'s sources."""
    dest = WORK / f"llama-cpp-python-{version}"
    root = dest / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    sdist = download_sdist("llama-cpp-python", version, WORK)
    with tarfile.open(sdist) as t:
        t.extractall(WORK, filter="data")
    extracted = WORK / f"llama_cpp_python-{version}"
    if extracted.exists() and not dest.exists():
        extracted.rename(dest)
    if not (root / "convert_hf_to_gguf.py").exists():
        sys.exit(f"convert_hf_to_gguf.py not found in {sdist}")
    return root
