"""The documentation's commands run, so README.md and docs/*.md cannot rot (issue 9).

Every ```bash / ```sh / ```console block of README.md and docs/*.md is read. Each line that runs
paratrain (continuation lines joined; `$ paratrain ...`, `python -m paratrain ...` and
`torchrun ... -m paratrain.train CONFIG ...` too) is run with a tiny step count, the blocks of one
page in order in one temporary directory (with `configs/` linked into it), so a command that needs
an earlier one's run (`generate`, `export`, `eval`, `--resume`) finds it. Each must exit 0; a
`console` block's command followed by a `paratrain: error: ...` line must exit 2 and print that
line. Lines that are not paratrain commands (`make`, `python benchmarks/...`) are not run; a
`NAME=...` line sets a shell variable for the page's later commands.

An HTML comment on the lines just above a block's opening fence changes how it runs:

    <!-- docs-test: skip (REASON) -->        not run (a GPU, several machines); the reason is required
    <!-- docs-test: preflight (REASON) -->   run up to the launcher: arguments, config, `--set` keys,
                                             the layout at that world size, trackers; no process starts
    <!-- docs-test: replace OLD NEW; ... --> text substitutions for the shrunk run, e.g. a checkpoint
                                             step that two steps reach
    <!-- docs-test: python -->               a ```python block, run as a script in the page's directory
                                             after the commands above it (must exit 0); other python
                                             blocks are not run

How each subcommand is shrunk is the table `SHRINK`; a subcommand it does not know fails the test,
so a new one gets a rule. A command already run in full by an earlier page (the same arguments
after shrinking) runs as a preflight: the README repeats the pages' examples.

`DOCS_TEST_PAGES="docs/x.md" pytest tests/e2e/test_docs.py` runs one page's commands while writing it.
The runner is this file run as a script (`python tests/e2e/test_docs.py PLAN.json`): one process
imports paratrain once and runs each command through `paratrain.cli.main` in a forked child
(preflights in the runner itself), which keeps the whole test near a minute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

from paratrain import cli
from paratrain.config import ConfigError, load_config
from paratrain.preflight import check_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
RUN_LANGS = {"bash", "sh", "shell", "console"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=(\$\(.*\)|\S*)$")  # NAME=$(...) or NAME=word, alone

# How each subcommand is shrunk to seconds: argv (after the subcommand) -> argv. argparse keeps the
# last value of a repeated option and `--set` applies in order, so appending wins over the docs' value.
TRAIN_STEPS = ["--set", "run.steps=2", "--set", "metrics.plot=false"]  # no matplotlib per run
SHRINK = {
    "train": lambda a: a + TRAIN_STEPS,
    "verify": lambda a: a + ["--steps", "2"],  # two runs (the layout, the reference) of 2 steps each
    "find-batch": lambda a: a,  # a debug-sized config estimates in seconds; main.toml blocks are preflight
    "plan": lambda a: a,  # a cost model over layouts: no process starts
    "eval": lambda a: a,  # evaluates a finished run of the page; its own config sets the sample count
    "config": lambda a: a,
    "env": lambda a: a,  # one process: versions and interfaces
    "export": lambda a: a,
    "prepare": lambda a: a,  # the docs shrink the inputs with a `replace` marker
    "report": lambda a: a,
    "generate": lambda a: a + ["--max-new-tokens", "8"],
    "bench comm": lambda a: a + ["--min-bytes", "4096", "--max-bytes", "8192", "--iters", "1", "--warmup", "1"],
    "bench compute": lambda a: a + ["--n", "64", "--copy-mib", "1", "--runs", "1", "--inner", "1"],
}


class DocsError(Exception):
    """A documentation block the test cannot run as written (the message names page:line and the fix)."""


@dataclasses.dataclass
class Command:
    page: str  # path relative to the repository
    line: int  # 1-based line of the command's first line
    text: str  # as written (continuations joined, replacements applied)
    mode: str  # "run" | "preflight" | "skip" | "assign" | "python" (text: the script)
    argv: list[str] = dataclasses.field(default_factory=list)  # what runs: ["paratrain", SUB, ...] or ["torchrun", ...]
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # leading NAME=VALUE words
    expect_rc: int = 0
    expect_error: str = ""  # a console block's documented error line
    reason: str = ""


def doc_pages() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def parse_marker(text: str, where: str) -> dict:
    """`skip (why)`, `preflight (why)`, `python` or `replace OLD NEW; replace OLD NEW` -> {mode, reason, replace}."""
    out = {"mode": "run", "reason": "", "replace": []}
    for part in (p.strip() for p in re.split(r";\s*(?=(?:skip|preflight|replace|python)\b)", text)):
        word, _, rest = part.partition(" ")
        if word == "python":
            out["mode"] = "python"
        elif word in ("skip", "preflight"):
            reason = rest.strip().strip("()").strip()
            if not reason:
                raise DocsError(f"{where}: `docs-test: {word}` needs a reason in parentheses")
            out["mode"], out["reason"] = word, reason
        elif word == "replace":
            pair = shlex.split(rest)
            if len(pair) != 2:
                raise DocsError(f"{where}: `docs-test: replace OLD NEW` takes two words, got {rest!r}")
            out["replace"].append(pair)
        else:
            raise DocsError(f"{where}: unknown docs-test marker {part!r} (skip, preflight, python or replace)")
    return out


def blocks(page: str, text: str):
    """Yield (first line number, language, lines, marker) for each fenced block of a markdown page."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        marker, k = [], start - 1
        while k >= 0 and (MARKER.match(lines[k]) or not lines[k].strip()) and start - k <= 3:
            if MARKER.match(lines[k]):
                marker.insert(0, MARKER.match(lines[k]).group(1))
            k -= 1
        yield start + 2, lang, lines[start + 1 : j], "; ".join(marker)
        i = j + 1


def logical_lines(first: int, lines: list[str]):
    """Join `\\` continuations: yield (line number, text, index of the next physical line)."""
    i = 0
    while i < len(lines):
        n, cur = first + i, lines[i]
        while cur.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cur = cur.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        yield n, cur, i


def paratrain_argv(words: list[str], where: str) -> list[str] | None:
    """["paratrain", ...] or ["torchrun", ...] for a paratrain command, None for any other line."""
    if words[:1] == ["paratrain"]:
        return words
    if words[:3] == ["python", "-m", "paratrain"]:
        return ["paratrain", *words[3:]]
    if words[:1] == ["torchrun"]:
        if "-m" not in words or words[words.index("-m") + 1 : words.index("-m") + 2] != ["paratrain.train"]:
            raise DocsError(f"{where}: a torchrun line must run `-m paratrain.train CONFIG` (or be in a skipped block)")
        return words
    if any(w == "paratrain" for w in words):
        raise DocsError(f"{where}: paratrain appears inside {' '.join(words[:3])!r}...: start the line with it")
    return None


def subcommand(argv: list[str], where: str) -> str:
    if argv[0] == "torchrun":
        return "train"
    sub = argv[1] if len(argv) > 1 else ""
    if sub == "bench" and len(argv) > 2:
        sub = f"bench {argv[2]}"
    if sub not in SHRINK:
        raise DocsError(
            f"{where}: `paratrain {sub}` has no rule in tests/e2e/test_docs.py SHRINK; add how to make it run in seconds"
        )
    return sub


def shrink(argv: list[str], where: str) -> list[str]:
    sub = subcommand(argv, where)
    if argv[0] == "torchrun":
        return argv + TRAIN_STEPS
    head = 1 + len(sub.split())
    return argv[:head] + SHRINK[sub](argv[head:])


def extract(page: str, text: str | None = None) -> list[Command]:
    """The page's commands in order, shrunk, with their mode."""
    if text is None:
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
    out = []
    for first, lang, lines, marker in blocks(page, text):
        opts = parse_marker(marker, f"{page}:{first}") if marker else {"mode": "run", "reason": "", "replace": []}
        if (lang == "python") != (opts["mode"] == "python"):
            if opts["mode"] == "python":
                raise DocsError(f"{page}:{first}: `docs-test: python` marks a ```{lang} block; mark a ```python block")
            continue
        if lang == "python":  # the docs' own Python, e.g. loading what the commands above wrote
            out.append(Command(page, first, "\n".join(lines), "python"))
            continue
        if lang not in RUN_LANGS:
            continue
        for n, raw, nxt in logical_lines(first, lines):
            where = f"{page}:{n}"
            line = raw.strip()
            if lang == "console":
                if not line.startswith("$ "):
                    continue  # output shown in the docs
                line = line[2:]
            for old, new in opts["replace"]:
                line = line.replace(old, new)
            if not line or line.startswith("#"):
                continue
            if SHELL_VARIABLE.match(line):
                out.append(Command(page, n, line, "assign" if opts["mode"] != "skip" else "skip"))
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError as e:
                raise DocsError(f"{where}: cannot split {line!r}: {e}") from None
            env = {}
            while words and ASSIGNMENT.match(words[0]) and len(words) > 1:
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            argv = paratrain_argv(words, where)
            if argv is None:
                continue
            cmd = Command(page, n, line, opts["mode"], argv=argv, env=env, reason=opts["reason"])
            if cmd.mode == "skip":
                out.append(cmd)
                continue
            if any(w in ("...", "CONFIG") or w.startswith("[") for w in argv):
                raise DocsError(f"{where}: {line!r} is a synopsis, not a command: put it in a plain ``` block")
            cmd.argv = shrink(argv, where)
            if lang == "console":
                following = lines[nxt] if nxt < len(lines) else ""
                if following.startswith("paratrain: error:"):
                    cmd.expect_rc, cmd.expect_error = 2, following.strip()
            out.append(cmd)
    return out


# ------------------------------------------------------------------------------------- tests


def test_rules_on_a_sample_page():
    page = "\n".join(
        [
            "```bash",
            "paratrain train configs/debug.toml --nproc-per-node 2 \\",
            "    --set parallel.tp=2   # a comment",
            "make test",
            "X=$(python -c 'print(1)')",
            "```",
            "<!-- docs-test: preflight (four processes) -->",
            "```sh",
            "torchrun --standalone --nproc-per-node 4 -m paratrain.train configs/debug.toml",
            "```",
            "<!-- docs-test: skip (needs a GPU) -->",
            "```bash",
            "paratrain anything-at-all",
            "```",
            "<!-- docs-test: replace step-100 step-1 -->",
            "```console",
            "$ paratrain export runs/x/checkpoints/step-100 --to m.safetensors",
            "exported ...",
            "$ paratrain config configs/debug.toml --set run.nope=1",
            "paratrain: error: unknown config key 'run.nope' ...",
            "```",
            "```",
            "paratrain train CONFIG [--set ...]",
            "```",
            "```python",
            "import not_run",
            "```",
            "<!-- docs-test: python -->",
            "```python",
            "print(1)",
            "```",
        ]
    )
    cmds = extract("sample.md", page)
    assert [(c.line, c.mode) for c in cmds] == [
        (2, "run"),
        (5, "assign"),
        (9, "preflight"),
        (13, "skip"),
        (17, "run"),
        (19, "run"),
        (30, "python"),
    ]
    assert cmds[-1].text == "print(1)"
    assert cmds[0].argv[-6:] == ["--set", "parallel.tp=2", *TRAIN_STEPS]
    assert cmds[2].argv[-4:] == TRAIN_STEPS and cmds[2].reason == "four processes"
    assert cmds[4].argv == ["paratrain", "export", "runs/x/checkpoints/step-1", "--to", "m.safetensors"]
    assert (cmds[4].expect_rc, cmds[5].expect_rc) == (0, 2)
    assert cmds[5].expect_error.startswith("paratrain: error: unknown config key")

    with pytest.raises(DocsError, match=r"sample.md:2: `paratrain frobnicate` has no rule"):
        extract("sample.md", "```bash\nparatrain frobnicate configs/debug.toml\n```")
    with pytest.raises(DocsError, match="needs a reason"):
        extract("sample.md", "<!-- docs-test: skip -->\n```bash\nparatrain env\n```")
    with pytest.raises(DocsError, match="is a synopsis"):
        extract("sample.md", "```bash\nparatrain train CONFIG [--nproc-per-node N]\n```")


def test_every_documented_command_has_a_rule():
    """Fast, no process: every page parses, every subcommand is known, no synopsis in a run block."""
    total = {"run": 0, "preflight": 0, "skip": 0}
    for page in doc_pages():
        for c in extract(page):
            if c.mode in total:
                total[c.mode] += 1
    assert total["run"] >= 20, total  # the README alone has a dozen


def test_readme_is_the_front_page():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make run" in quick and "make test" in quick  # both set up a fresh machine
    for page in ["data-parallel", "model-parallel", "batch-size", "communication", "checkpoints", "configuration"]:
        assert f"(docs/{page}.md)" in readme, page
    for page in ["benchmarks", "data", "security", "observability", "structure", "plan", "huggingface", "resilience"]:
        assert f"(docs/{page}.md)" in readme, page
    for path in re.findall(r"\]\((docs/[^)#]+)", readme):  # pages not merged yet are listed in PENDING_PAGES
        assert os.path.exists(os.path.join(REPO, path)) or path in PENDING_PAGES, path
    assert len(readme.split("\n")) < 200  # the front page, not the manual


def test_named_files_and_modules_exist():
    """Every repository path (`tests/...`, `benchmarks/...`, `configs/...`, `docs/...`, `src/...`) and every
    `paratrain.x.y` name a page mentions exists: a rename in the code fails here, not in a reader's hands."""
    missing = []
    for page in doc_pages():
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        base = os.path.dirname(os.path.join(REPO, page))
        for path in re.findall(r"(?<![\w./:-])((?:tests|benchmarks|configs|docs|src)/[\w/.-]*\w)", text):
            if not (os.path.exists(os.path.join(REPO, path)) or path in PENDING_PAGES):
                missing.append(f"{page}: {path}")
        for link, anchor in re.findall(r"\]\(([\w./-]*)(?:#([\w-]*))?\)", text):  # relative links, #anchors
            target = os.path.normpath(os.path.join(base, link)) if link else os.path.join(REPO, page)
            if os.path.relpath(target, REPO) in PENDING_PAGES:
                continue
            if not os.path.exists(target):
                missing.append(f"{page}: link {link}")
            elif anchor and target.endswith(".md") and anchor not in heading_anchors(target):
                missing.append(f"{page}: link {link}#{anchor} (no such heading)")
        for name in re.findall(r"`(paratrain(?:\.\w+)+)", text):
            if not resolves(name):
                missing.append(f"{page}: {name}")
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)


def heading_anchors(path: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def find_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def resolves(name: str) -> bool:
    """`paratrain.a.b` is an attribute chain from the package or an importable module (not imported: no side effects)."""
    parts = name.split(".")
    obj = importlib.import_module("paratrain")
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif find_module(".".join(parts[:i])):
            obj = importlib.import_module(".".join(parts[:i])) if i < len(parts) else None
        else:
            return False
    return True


# Pages other branches bring (the lead merges them); the README links them already.
PENDING_PAGES: set[str] = set()


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 20 short launches: a minute on a quiet 2-core machine, several on a loaded one
def test_documented_commands_run(tmp_path):
    # Pages first, the README last: its examples repeat the pages' and then only need a preflight.
    # DOCS_TEST_PAGES="docs/a.md docs/b.md" runs only those (while writing a page).
    pages = os.environ.get("DOCS_TEST_PAGES", "").split() or doc_pages()[1:] + ["README.md"]
    plan = [dataclasses.asdict(c) for p in pages for c in extract(p)]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]),
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    with open(tmp_path / "output.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(plan_file), str(tmp_path / "pages")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        summary = []
        for line in proc.stdout:  # progress as each command ends (pytest -s shows it)
            if line.startswith("docs-test"):
                print(line, end="", flush=True)
                summary.append(line.rstrip())
        rc = proc.wait()
    failures = [line for line in summary if line.startswith("docs-test FAIL")]
    assert rc == 0 and not failures, "\n".join(failures or summary[-3:]) + f"\n(outputs: {tmp_path / 'output.txt'})"


# ------------------------------------------------------------------------------------- runner


def preflight(argv: list[str]) -> int:
    """Everything `paratrain train/verify/find-batch/bench/env` checks before a process starts."""
    args = cli.build_parser().parse_args(argv)
    config = getattr(args, "config", None)
    if config:
        cfg = load_config(config, args.overrides)
        nodes, procs = getattr(args, "nnodes", 1), getattr(args, "nproc_per_node", 1)
        check_run(cfg, nodes * procs)
    if args.command == "train":
        # A preflight checks the command, not what the page's earlier runs left in its run.out_dir
        # (a second run there is refused unless --overwrite, docs/configuration.md#outputs; the
        # check removes nothing: the run's rank 0 does).
        args.overwrite = True
    if args.command in ("train", "bench", "env"):
        from paratrain.launch import agent  # the CLI imports launch from there when a command runs

        real = agent.launch
        agent.launch = lambda *a, **k: 0  # stop where the processes would start
        try:
            return args.func(args)
        finally:
            agent.launch = real
    if hasattr(args, "nproc_per_node") and hasattr(args, "rdzv_endpoint"):
        cli.launch_spec(args)
    return 0


def torchrun_as_train(argv: list[str]) -> list[str]:
    """`torchrun --nproc-per-node N ... -m paratrain.train CONFIG ARGS` -> `train CONFIG --nproc-per-node N ARGS`."""
    m = argv.index("-m")
    nproc = "1"
    for i, w in enumerate(argv[:m]):
        if w.startswith("--nproc-per-node") or w.startswith("--nproc_per_node"):
            nproc = w.split("=", 1)[1] if "=" in w else argv[i + 1]
    return ["train", argv[m + 2], "--nproc-per-node", nproc, *argv[m + 3 :]]


def run_one(c: dict) -> tuple[int, str]:
    argv = [os.path.expandvars(w) for w in c["argv"]]
    if argv[0] == "torchrun" and c["mode"] == "run":
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], capture_output=True, text=True)
        return p.returncode, p.stderr
    args = torchrun_as_train(argv) if argv[0] == "torchrun" else argv[1:]
    if c["mode"] == "run":
        return run_in_child(args)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = preflight(args) if c["mode"] == "preflight" else cli.main(args)
    except ConfigError as e:  # preflight calls the checks outside cli.main's handler
        err.write(f"paratrain: error: {e}\n")
        rc = 2
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 1
    sys.stderr.write(err.getvalue()[-2000:])
    return rc, err.getvalue()


def run_in_child(args: list[str]) -> tuple[int, str]:
    """``paratrain ARGS`` in a forked child: paratrain is imported once (here), yet nothing a command
    leaves in its process (signal handlers, environment, torch elastic's state) reaches the next
    one, as with separate invocations from a shell. (In one process, a one-process `train` followed
    by a two-process `eval` lost a worker to a SIGTERM.)"""
    with tempfile.TemporaryFile("w+") as f:
        pid = os.fork()
        if pid == 0:  # the child: run the command, report through the exit code and the file
            rc = 1
            try:
                with contextlib.redirect_stderr(f):
                    rc = cli.main(args)
            except SystemExit as e:  # argparse
                rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - a traceback is a failure the test reports
                traceback.print_exc(file=f)
            finally:
                f.flush()
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        f.seek(0)
        err = f.read()
    sys.stderr.write(err[-2000:])
    return os.waitstatus_to_exitcode(status), err


def run_plan(plan_file: str, root: str) -> int:
    with open(plan_file) as f:
        plan = json.load(f)
    done: dict[str, str] = {}  # shrunk argv already run in full -> where
    failed = 0
    start_all = time.perf_counter()
    page_dir, base_env = "", dict(os.environ)
    for c in plan:
        if page_dir != os.path.join(root, c["page"].replace("/", "_")):  # a new page: a fresh directory and shell
            page_dir = os.path.join(root, c["page"].replace("/", "_"))
            os.makedirs(page_dir)
            os.symlink(os.path.join(REPO, "configs"), os.path.join(page_dir, "configs"))
            os.chdir(page_dir)
            os.environ.clear()
            os.environ.update(base_env)
        where = f"{c['page']}:{c['line']}"
        if c["mode"] == "skip":
            print(f"docs-test skip      {where}  ({c['reason']}): {c['text']}", flush=True)
            continue
        if c["mode"] == "python":
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", c["text"]], capture_output=True, text=True)
            sys.stderr.write(p.stderr[-2000:])
            status = "ok  " if p.returncode == 0 else "FAIL"
            print(
                f"docs-test {status} {time.perf_counter() - t0:5.1f}s {where} [python]: {p.stdout.strip()[-200:]}",
                flush=True,
            )
            if p.returncode:
                last = ([line for line in p.stderr.strip().split("\n") if line.strip()] or ["(no output)"])[-1]
                print(f"docs-test FAIL {where}: the python block exited {p.returncode}; last line: {last}", flush=True)
                failed += 1
            continue
        if c["mode"] == "assign":
            name = c["text"].split("=", 1)[0]
            value = subprocess.run(
                ["bash", "-c", f'{c["text"]}\nprintf %s "${name}"'], capture_output=True, text=True, check=True
            ).stdout
            os.environ[name] = value
            print(f"docs-test assign    {where}: {name}={value}", flush=True)
            continue
        key = json.dumps(c["argv"])
        if c["mode"] == "run" and key in done and not c["expect_error"]:
            c["mode"], c["reason"] = "preflight", f"run in full at {done[key]}"
        saved = {k: os.environ.get(k) for k in c["env"]}
        os.environ.update({k: os.path.expandvars(v) for k, v in c["env"].items()})
        t0 = time.perf_counter()
        rc, err = run_one(c)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        ok = rc == c["expect_rc"] and (not c["expect_error"] or c["expect_error"] in err)
        if ok and c["mode"] == "run" and rc == 0:
            done[key] = where
        mode = c["mode"] + (f" ({c['reason']})" if c["mode"] == "preflight" else "")
        status = "ok  " if ok else "FAIL"
        print(
            f"docs-test {status} {time.perf_counter() - t0:5.1f}s {where} [{mode}]: {' '.join(c['argv'])}", flush=True
        )
        if not ok:
            last = [line for line in err.strip().split("\n") if line.strip()][-1:] or ["(no output)"]
            want = c["expect_error"] or f"exit {c['expect_rc']}"
            print(f"docs-test FAIL {where}: exit {rc}, wanted {want}; last line: {last[0]}", flush=True)
            failed += 1
    print(f"docs-test total {time.perf_counter() - start_all:.1f}s, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_plan(sys.argv[1], sys.argv[2]))
