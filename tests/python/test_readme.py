"""README.md runs as written: every fenced code block is run as a user would run it, from the
checkout, and what it prints is compared with the ```text block that follows it.

How blocks are run (each in a fresh process, working directory = the checkout):
  python        this interpreter (the project's .venv); the block loads the package itself, through
                the kernels loader
  cpp           built as main.cpp of a CMake project that does find_package(scatter_add) against
                the library installed from this checkout into .build/readme/prefix, then run
  cmake         the block is that project's CMakeLists.txt, with the nearest C++ block above it as
                main.cpp (and the checkout at third_party/scatter-add); the program must print
                what that C++ block shows
  bash / sh     bash -euo pipefail (under flock .build/release.lock, as the Makefile's `cpp`
                target builds .build/release)
  text          the output of the block above it (or an illustration); not run

A comment line right above a block's opening fence adjusts how it runs, `;`-separated:
  <!-- readme-test: skip: REASON -->       not run; the test reports it skipped with REASON
  <!-- readme-test: needs: cuda -->        run where torch sees a CUDA device, reported skipped
                                           elsewhere
  <!-- readme-test: env: K=V K2=V2 -->     extra environment ({root} is the checkout), e.g.
                                           LOCAL_KERNELS=org/scatter-add={root} HF_HUB_OFFLINE=1
                                           to run a Hub block against this checkout
  <!-- readme-test: any order -->          compare printed lines in any order (several processes)
  <!-- readme-test: timeout: SECONDS -->   default 300
In expected output, `...` stands for any text within a line.
"""
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN_LANGS = {"python": "python", "py": "python", "cpp": "cpp", "c++": "cpp", "cmake": "cmake",
             "bash": "bash", "sh": "bash", "shell": "bash"}
OUTPUT_LANGS = {"text", "console", "output"}
MARKER = re.compile(r"^\s*<!--\s*readme-test:(.*?)-->\s*$")


@dataclass
class Block:
    lang: str          # the fence's info string, lower case
    line: int          # 1-based line of the opening fence
    code: str
    options: dict = field(default_factory=dict)
    expected: list = None    # lines of the ```text block right after it, or None
    main_cpp: "Block" = None  # for cmake blocks: the C++ block above

    @property
    def kind(self):
        return RUN_LANGS.get(self.lang)

    @property
    def id(self):
        needs = f"-{self.options['needs']}" if "needs" in self.options else ""
        return f"{self.lang}-L{self.line}{needs}"


def parse_options(text):
    opts = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, value = part.partition(":")
        opts[key.strip()] = value.strip() or True
    return opts


def parse_readme(text):
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i >= len(lines):
            raise AssertionError(f"README.md line {start + 1}: a ``` block that is never closed")
        i += 1
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(lang, start + 1, "\n".join(body) + "\n",
                            parse_options(marker.group(1)) if marker else {}))
    # An output block belongs to the block right above it (blank lines between are allowed).
    out = []
    for b in blocks:
        if b.lang in OUTPUT_LANGS and out and out[-1].kind and out[-1].expected is None:
            between = lines[out[-1].line + out[-1].code.count("\n"): b.line - 1]
            if all(not s.strip() or s.strip().startswith("```") for s in between):
                out[-1].expected = b.code.rstrip("\n").splitlines()
                continue
        out.append(b)
    last_cpp = None
    for b in out:
        if b.kind == "cpp":
            last_cpp = b
        elif b.kind == "cmake":
            b.main_cpp = last_cpp
    return out


BLOCKS = parse_readme(README.read_text())
RUNNABLE = [b for b in BLOCKS if b.kind]


def test_every_block_is_runnable_or_output():
    """A block in a language this test cannot run would be silently unchecked: fail instead."""
    bad = [f"line {b.line}: ```{b.lang}" for b in BLOCKS
           if not b.kind and b.lang not in OUTPUT_LANGS and "skip" not in b.options]
    assert not bad, ("README blocks in a language the README test does not run (use python, cpp, "
                     "cmake, bash or text, or mark them `<!-- readme-test: skip: REASON -->`): " + ", ".join(bad))
    assert any(b.kind == "python" for b in RUNNABLE) and any(b.kind == "cpp" for b in RUNNABLE)


def matches(expected, actual, any_order=False):
    """Line by line after stripping trailing blanks; `...` in an expected line matches any text."""
    def norm(ls):
        ls = [s.rstrip() for s in ls]
        while ls and not ls[-1]:
            ls.pop()
        return ls

    exp, act = norm(expected), norm(actual)
    if len(exp) != len(act):
        return False
    pats = [re.compile("^" + ".*".join(re.escape(p) for p in e.split("...")) + "$") for e in exp]
    if not any_order:
        return all(p.match(a) for p, a in zip(pats, act))
    left = list(act)
    for p in pats:  # greedy is enough: each expected line is matched to one printed line
        hit = next((a for a in left if p.match(a)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True


def run(cmd, cwd, env=None, timeout=300):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def checked(r, what):
    assert r.returncode == 0, f"{what} failed with exit code {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


# The library's copies that this test builds (the installed one, and the one a cmake block adds as
# a subproject) are unoptimised: the blocks check what the programs print, which the summation
# contract makes the same at every optimisation level, and -O0 compiles the core in about a
# quarter of -O2's time (17 s against 73 s on two cores).
UNOPTIMISED = ["-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"]


@pytest.fixture(scope="session")
def installed_prefix():
    """The C++ library of this checkout installed as a user would (cmake --install), into
    .build/readme/prefix; the build directory is kept, so a second run only rebuilds what changed."""
    build, prefix = ROOT / ".build" / "readme" / "core", ROOT / ".build" / "readme" / "prefix"
    jobs = str(os.cpu_count() or 2)
    checked(run(["cmake", "-S", str(ROOT), "-B", str(build), *UNOPTIMISED, "-DSCATTER_ADD_TESTS=OFF",
                 "-DSCATTER_ADD_BENCH=OFF", "-DSCATTER_ADD_EXAMPLES=OFF"], ROOT), "configuring the library")
    checked(run(["cmake", "--build", str(build), "-j", jobs], ROOT, timeout=900), "building the library")
    shutil.rmtree(prefix, ignore_errors=True)
    checked(run(["cmake", "--install", str(build), "--prefix", str(prefix)], ROOT), "installing the library")
    return prefix


FIND_PACKAGE_PROJECT = """cmake_minimum_required(VERSION 3.18)
project(readme_block LANGUAGES CXX)
find_package(scatter_add CONFIG REQUIRED)
add_executable(app main.cpp)
target_link_libraries(app PRIVATE scatter_add::scatter_add)
"""


def build_and_run_cpp(project_dir, cmakelists, main_cpp, prefix, env, timeout):
    """project_dir is kept under .build/readme/, so that a second run rebuilds only what changed."""
    project_dir.mkdir(parents=True, exist_ok=True)
    (project_dir / "CMakeLists.txt").write_text(cmakelists)
    (project_dir / "main.cpp").write_text(main_cpp)
    m = re.search(r"add_subdirectory\(\s*([^\s)]+)", cmakelists)
    if m:  # the checkout where the block expects it, e.g. third_party/scatter-add
        dest = project_dir / m.group(1)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.is_symlink():
            dest.symlink_to(ROOT, target_is_directory=True)
    exe = re.search(r"add_executable\(\s*(\w+)", cmakelists)
    assert exe, "the CMake block defines no executable (add_executable) to run"
    build = project_dir / "build"
    checked(run(["cmake", "-S", str(project_dir), "-B", str(build), *UNOPTIMISED,
                 f"-DCMAKE_PREFIX_PATH={prefix}"], project_dir, env), "configuring the block's project")
    checked(run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], project_dir, env, timeout),
            "building the block's project")
    return run([str(build / exe.group(1))], ROOT, env, timeout)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block(block, request):
    where = f"README.md line {block.line} (```{block.lang})"
    opts = block.options
    if "skip" in opts:
        pytest.skip(f"{where} not run: {opts['skip']}")
    if opts.get("needs") == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{where} needs a CUDA device; none here")
    elif "needs" in opts:
        raise AssertionError(f"{where}: unknown `needs: {opts['needs']}` (known: cuda)")
    if block.kind == "python" and re.search(r"^\s*(from|import) kernels\b", block.code, re.M):
        try:
            import kernels  # noqa: F401
        except ImportError:
            pytest.skip(f"{where} loads the package through `kernels`, which is not installed here")
        import torch

        default = "cpu" if torch.version.cuda is None else "cuda"
        wanted = os.environ.get("SCATTER_ADD_BACKEND", default)
        if wanted != default:  # the block calls the loader as a user does, with its default backend
            pytest.skip(f"{where} loads the {default} variant (the loader's default on torch {torch.__version__}), "
                        f"this run asks for SCATTER_ADD_BACKEND={wanted}; `make test-python` runs it on the .venv's torch")
    env = dict(kv.split("=", 1) for kv in str(opts.get("env", "")).split()) if "env" in opts else {}
    env = {k: v.replace("{root}", str(ROOT)) for k, v in env.items()}
    timeout = int(opts.get("timeout", 300))

    if block.kind == "python":
        r = run([sys.executable, "-c", block.code], ROOT, env, timeout)
    elif block.kind == "bash":
        # Under the lock of the Makefile's `cpp` target: a block may build .build/release, which
        # make test's other lane builds and installs from.
        (ROOT / ".build").mkdir(exist_ok=True)
        r = run(["flock", str(ROOT / ".build" / "release.lock"), "bash", "-euo", "pipefail", "-c", block.code],
                ROOT, env, timeout)
    else:
        prefix = request.getfixturevalue("installed_prefix")
        project = ROOT / ".build" / "readme" / f"{block.kind}{[b for b in RUNNABLE if b.kind == block.kind].index(block)}"
        if block.kind == "cpp":
            r = build_and_run_cpp(project, FIND_PACKAGE_PROJECT, block.code, prefix, env, timeout)
        else:
            assert block.main_cpp is not None, f"{where}: no C++ block above it to build as main.cpp"
            r = build_and_run_cpp(project, block.code, block.main_cpp.code, prefix, env, timeout)
    checked(r, where)
    expected = block.expected
    if expected is None and block.kind == "cmake":
        expected = block.main_cpp.expected
    if expected is None:
        return  # nothing shown, nothing to compare: it ran without an error
    if not matches(expected, r.stdout.splitlines(), opts.get("any order", False)):
        pytest.fail(f"{where} printed something else than the README shows.\n--- README\n" + "\n".join(expected) +
                    "\n--- printed\n" + r.stdout + ("\n--- stderr\n" + r.stderr[-2000:] if r.stderr else ""),
                    pytrace=False)


def test_matches_compares_lines():
    assert matches(["a 1", "b ... c"], ["a 1", "b anything c", ""])
    assert not matches(["a 1"], ["a 2"])
    assert not matches(["a", "b"], ["a"])
    assert matches(["x", "y"], ["y", "x"], any_order=True)
    assert not matches(["x", "x"], ["x", "y"], any_order=True)
