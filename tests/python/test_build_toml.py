"""build.toml (kernel-builder's format) against CMake, which builds the extension here: both must
compile the same sources with the same code-changing flags, per backend, and list every header
those sources include. CMake's view comes from its file API (the code model of a fresh configure
of the extension); build.toml is parsed by the `kernels` package's own parser too."""
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
NVCC = shutil.which("nvcc")
COMPILED = (".cpp", ".cc", ".cu")


def test_parses_with_the_kernel_builders_parser():
    from kernels._rust import Backend, Build

    build = Build.open(ROOT)
    assert set(build.general.backends) == {Backend.CPU, Backend.CUDA}
    for kind, target in CONFIG["torch"]["stable-abi"].items():
        assert kind in ("cpu", "cuda") and re.fullmatch(r"\d+\.\d+", target), (kind, target)
    assert (ROOT / "torch-ext" / CONFIG["general"]["name"].replace("-", "_") / "__init__.py").is_file()


def relevant_flags(flags):
    """The flags that change what code a source compiles to: instruction sets, floating-point
    contraction and this project's own switches (OpenMP, the bf16 kernels, AMX)."""
    return frozenset(f for f in flags if f.startswith(("-m", "-ffp-contract"))
                     or re.match(r"-DSCATTER_ADD_(USE_OPENMP|AVX512_BF16|AMX)\b", f))


def toml_units(kind):
    """(source, flags) for every source build.toml compiles into the `kind` extension."""
    units = [(s, relevant_flags(CONFIG["torch"].get("cxx-flags", []))) for s in CONFIG["torch"]["src"]]
    for k in CONFIG["kernel"].values():
        if k["backend"] == kind:
            units += [(s, relevant_flags(k.get("cxx-flags", []))) for s in k["src"]]
    return Counter((s, f) for s, f in units if s.endswith(COMPILED))


def cmake_units(build_dir, kind):
    """(source, flags) for every source CMake compiles into the extension target, following its
    dependencies (the core, its per-ISA objects, the CUDA library), from the file API's reply."""
    reply = build_dir / ".cmake" / "api" / "v1" / "reply"
    index = json.loads(sorted(reply.glob("index-*.json"))[-1].read_text())
    model = json.loads((reply / index["reply"]["codemodel-v2"]["jsonFile"]).read_text())
    targets = {t["id"]: t for t in model["configurations"][0]["targets"]}
    by_name = {t["name"]: t for t in targets.values()}
    todo, seen, units = [by_name["scatter_add_ext"]["id"]], set(), Counter()
    while todo:
        tid = todo.pop()
        if tid in seen:
            continue
        seen.add(tid)
        t = json.loads((reply / targets[tid]["jsonFile"]).read_text())
        todo += [d["id"] for d in t.get("dependencies", [])]
        groups = t.get("compileGroups", [])
        for src in t.get("sources", []):
            if "compileGroupIndex" not in src or not src["path"].endswith(COMPILED):
                continue
            g = groups[src["compileGroupIndex"]]
            flags = [w for frag in g.get("compileCommandFragments", []) for w in frag["fragment"].split()]
            flags += [f"-D{d['define']}" for d in g.get("defines", [])]
            path = Path(src["path"])
            rel = (path if path.is_absolute() else ROOT / path).resolve().relative_to(ROOT)
            units[(str(rel), relevant_flags(flags))] += 1
    return units, by_name, reply


@pytest.fixture(scope="module")
def configure(tmp_path_factory):
    """configure(kind) -> a build directory CMake configured for the `kind` extension, once per
    kind for this module (a configure takes 5 to 15 s)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_hub import cmake_configure

    done = {}

    def get(kind):
        if kind not in done:
            build_dir = tmp_path_factory.mktemp(f"cmake-{kind}")
            cmake_configure(build_dir, "_scatter_add_toml_check", CONFIG["torch"]["stable-abi"][kind],
                            cuda=kind == "cuda")
            done[kind] = build_dir
        return done[kind]

    return get


@pytest.mark.parametrize("kind", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(NVCC is None, reason="nvcc not found: CMake cannot configure "
                                                                      "the CUDA extension on this machine")),
])
def test_lists_what_cmake_compiles(configure, kind):
    build_dir = configure(kind)
    cmake, _, _ = cmake_units(build_dir, kind)
    toml = toml_units(kind)
    assert toml == cmake, (f"build.toml ({kind}) and CMake differ:\n  only in build.toml: {sorted(toml - cmake)}\n"
                           f"  only in CMake: {sorted(cmake - toml)}")


def test_binding_is_compiled_for_the_target_version(configure):
    """The binding is compiled with TORCH_TARGET_VERSION, which makes every header outside the
    stable ABI an #error, for the version build.toml names."""
    build_dir = configure("cpu")
    _, by_name, reply = cmake_units(build_dir, "cpu")
    t = json.loads((reply / by_name["scatter_add_ext"]["jsonFile"]).read_text())
    defines = {d["define"] for g in t["compileGroups"] for d in g.get("defines", [])}
    major, minor = (int(v) for v in CONFIG["torch"]["stable-abi"]["cpu"].split("."))
    assert f"TORCH_TARGET_VERSION=0x{(major << 56) | (minor << 48):016x}" in defines, sorted(defines)


def included_headers(source, include_dirs):
    """Every header of this repository that `source` includes, transitively (quoted includes,
    looked up next to the including file, then in include_dirs)."""
    found, todo = set(), [ROOT / source]
    while todo:
        f = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', f.read_text(), re.M):
            for base in [f.parent] + [ROOT / d for d in include_dirs]:
                h = (base / name).resolve()
                if h.is_file() and ROOT in h.parents:
                    rel = str(h.relative_to(ROOT))
                    if rel not in found:
                        found.add(rel)
                        todo.append(h)
                    break
    return found


def test_lists_every_header_its_sources_include():
    """kernel-builder builds from the listed files only: a header a section's sources include must
    be listed in that section."""
    sections = {"torch": CONFIG["torch"], **{f"kernel.{n}": k for n, k in CONFIG["kernel"].items()}}
    missing = {}
    for name, sec in sections.items():
        listed = set(sec["src"])
        for s in sec["src"]:
            assert (ROOT / s).is_file(), f"[{name}] lists {s}, which does not exist"
            if s.endswith(COMPILED):
                need = included_headers(s, sec.get("include", [])) - listed
                if need:
                    missing[name] = sorted(need)
    assert missing == {}
