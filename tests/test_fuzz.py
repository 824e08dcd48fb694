"""A fuzz pass over config overrides: wrong types, out-of-range values, unknown keys and odd strings never
end in a traceback; every case exits 2 with a message naming the key."""

from __future__ import annotations

import random
from dataclasses import fields, is_dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from l2l_cli.cli import train
from l2l_cli.config import L2LConfig
from tests.util import TINY, l2l

ODD = [
    "abc",
    "",
    "1.5.3",
    "[1,2]",
    "{a: 1}",
    "ünïcödé ✓",
    "$(rm -rf /)",
    "'quoted'",
    "x" * 5000,
    "-",
    "true false",
    "\\n",
]
NON_FINITE = ["nan", "inf", "-inf", "1e400"]  # invalid for every numeric key (ints: wrong type)
OUT_OF_RANGE = [
    "model.num_layers=0",
    "model.num_layers=10000000",
    "model.hidden_size=-8",
    "model.num_heads=0",
    "model.dropout=1.0",
    "batch.size=0",
    "batch.ubatch_size=-2",
    "optim.lr=0",
    "optim.lr=-1e-3",
    "optim.beta2=1.0",
    "task.max_seq_len=2",
    "sim.memory_gb=0",
    "sim.link_gbps=-1",
    "trainer.max_steps=-5",
    "trainer.log_every=0",
    "dist.nproc=0",
    "dist.nproc=100000",
    "precision.init_scale=-1",
    "plan.max_transfer_overhead=1.5",
]


def schema_keys(node: object = L2LConfig, prefix: str = "") -> list[tuple[str, type]]:
    out = []
    for f in fields(node):  # type: ignore[arg-type]
        typ = (
            f.type
            if not isinstance(f.type, str)
            else eval(f.type, vars(__import__("l2l_cli.config.schema").config.schema))
        )
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", typ))
    return out


KEYS = schema_keys()
NUMBERS = [k for k, t in KEYS if t in (int, float)]
STRINGS = [k for k, t in KEYS if t is str]


def cases() -> list[tuple[list[str], str]]:
    rng = random.Random(1234)
    out: list[tuple[list[str], str]] = []
    for key in NUMBERS:  # wrong types and out-of-range values, for every numeric key
        for v in rng.sample(ODD, 3) + rng.sample(NON_FINITE, 2):
            out.append(([f"{key}={v}"], key))
    for override in OUT_OF_RANGE:
        out.append(([override], override.split("=")[0]))
    for key in STRINGS:  # values outside the allowed set
        if key in ("model.name", "task.tokenizer", "hardware.name"):
            continue
        out.append(([f"{key}={rng.choice(ODD[1:])}"], key))
    for key in (
        "foo",
        "model.foo",
        "batch.ubatch",
        "trainer.max_step",
        "model.num_layers.x",
        "optim.adamw.lr",
    ):
        out.append(([f"{key}=1"], key))
        out.append(([f"+{key}=1"], key))
    for group in ("model", "mode", "precision", "task", "optim", "recipe"):
        for v in ("nope", "../../etc/passwd", "", "ＲＴＥ"):
            out.append(([f"{group}={v}"], group))
    out += [(["=5"], "=5"), (["model==x"], "model"), (["batch.size=${oc.env:HOME}"], "batch.size")]
    rng.shuffle(out)
    return out


CASES = cases()


def test_fuzz_covers_the_schema() -> None:
    assert len(NUMBERS) >= 40 and len(STRINGS) >= 12 and len(CASES) > 300


def check_bad_overrides(capsys, cases: list[tuple[list[str], str]]) -> None:
    failures = []
    for overrides, key in cases:
        try:
            code = train(overrides)
        except BaseException as e:
            failures.append(f"{overrides}: raised {type(e).__name__}: {e}")
            continue
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if (
            code != 2
            or not lines
            or not all(ln.startswith("l2l: config error: ") for ln in lines)
            or key not in err
        ):
            failures.append(f"{overrides}: exit {code}, stderr {err[:300]!r}")
    assert not failures, "\n".join(failures[:20])


def test_fuzz_a_quarter_of_the_bad_overrides_exit_2_naming_the_key(capsys) -> None:
    check_bad_overrides(capsys, CASES[::4])  # a quarter in the default suite (the cases are shuffled)


@pytest.mark.slow
def test_fuzz_the_other_bad_overrides(capsys) -> None:
    check_bad_overrides(capsys, [c for i, c in enumerate(CASES) if i % 4])


@pytest.mark.parametrize("args", [["batch.size=abc", "+x.y=1"], ["model.hidden_size=nan"], ["task=../../x"]])
def test_fuzz_through_the_real_cli(args: list[str]) -> None:
    r = l2l("train", *args, fresh=True)  # a new interpreter: nothing said at import reaches stderr either
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("l2l: config error: ")


# ---- a property test: random command lines, composed, validated and started -----------------------


# the run every drawn command line starts from: a tiny model, one step, no evaluation set to speak of
FUZZ_BASE = [
    *TINY[:-1],
    "trainer.max_steps=1",
    "task.num_train=16",
    "task.num_eval=8",
    "trainer.progress=none",
]
# keys whose valid values would make a run slow or spawn processes: only invalid values are drawn for them
COSTLY = {
    "trainer.max_steps",
    "trainer.epochs",
    "task.num_train",
    "task.num_eval",
    "dist.nproc",
    "plan.measure_repeats",
    "task.max_train_samples",
    "task.max_eval_samples",
    "trainer.save_every",
}
ODD_PATHS = ["../../etc/passwd", "~/nope/ünï", "/dev/null", "", " ", "a\tb", "/proc/self", "x" * 300, "C:\\x"]
UNICODE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


def _value(key: str, kind: type) -> st.SearchStrategy[str]:
    numbers = st.one_of(st.integers(-3, 0), st.integers(10**7, 10**12), st.sampled_from(NON_FINITE))
    if key not in COSTLY:
        numbers = st.one_of(numbers, st.integers(1, 4))  # small valid values too: a tiny model still
    if kind is float:
        numbers = st.one_of(numbers, st.floats(-2, 2, allow_nan=False).map(repr))
    return st.one_of(numbers.map(str), st.sampled_from(ODD), UNICODE)


OVERRIDE = st.one_of(
    st.sampled_from(NUMBERS).flatmap(lambda k: _value(k, float).map(lambda v: f"{k}={v}")),
    st.sampled_from(STRINGS).flatmap(
        lambda k: st.one_of(st.sampled_from(ODD), UNICODE).map(lambda v: f"{k}={v}")
    ),
    st.sampled_from(
        ["task.data_dir", "eps.path", "model.pretrained", "task.files", "trainer.resume"]
    ).flatmap(lambda k: st.sampled_from(ODD_PATHS).map(lambda v: f"{k}={v}")),
    st.sampled_from(["foo", "model.foo", "+batch.ubatch", "+x.y", "optim.adamw.lr", "~model"]).map(
        lambda k: f"{k}=1"
    ),
    st.sampled_from(
        [
            "mode=baseline",
            "mode=baseline_ag",
            "mode=l2l",
            "mode=l2l_p",
            "mode=l2l_stash_cpu",
            "precision=cmp",
            "precision=amp",
            "precision=mixed",
            "optim=lamb",
            "task=lm",
            "model=gpt2-tiny",
            "model=llama-tiny",
            "eps.tier=disk",
            "device=sim",
            "optim.clip=layer",
            "batch.ubatch_size=8",
            "mode.stash=cpu",
            "model=ünï",
            "mode=../x",
            "task=",
            "dist.pipeline=2",
            "trainer.realtime_ckpt=true",
            "logger=[csv,csv]",
        ]
    ),
)


def check_outcome(overrides: list[str], run_dir) -> str | None:
    """What is wrong with how ``l2l train`` ended on ``overrides`` (None: exit 0 with a run, or exit 2
    with one ``l2l: `` line per problem and no run dir)."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = train([*overrides, f"hydra.run.dir={run_dir}"])
    except BaseException as e:  # a traceback is the bug this test looks for
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    text = err.getvalue()
    if "Traceback" in text:
        return f"exit {code} with a traceback: {text[-300:]!r}"
    if code == 0:
        return None if (run_dir / "summary.json").is_file() else "exit 0 without a summary.json"
    if code != 2:
        return f"exit {code}: {text[-300:]!r}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or not all(ln.startswith("l2l: ") for ln in lines):
        return f"exit 2 without one 'l2l: ' line per problem: {text[:300]!r}"
    if run_dir.exists():
        return "a refused config left a run dir"
    return None


def fuzz_command_lines(tmp_path_factory, examples: int) -> None:
    seen: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(OVERRIDE, min_size=1, max_size=4))
    def case(drawn: list[str]) -> None:
        run_dir = tmp_path_factory.mktemp("fuzz") / "run"
        problem = check_outcome([*FUZZ_BASE, *drawn], run_dir)
        seen.append("ok" if problem is None else problem)
        assert problem is None, f"{drawn}: {problem}"

    case()
    assert len(seen) >= examples // 2  # hypothesis ran the cases (it may stop early on duplicates)


def test_fuzz_random_command_lines_start_or_are_refused_in_one_line_each(tmp_path_factory) -> None:
    fuzz_command_lines(tmp_path_factory, 6)  # a sample (derandomized: the same 6 each time); 500: -m slow


@pytest.mark.slow
def test_fuzz_random_command_lines_500(tmp_path_factory) -> None:
    fuzz_command_lines(tmp_path_factory, 500)


# ---- data files: broken lines, wrong encodings, empty files, wrong types, for every task kind -------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran", "to", "it"]


def _valid_rows(kind: str) -> list[bytes]:
    """A small valid file of each task kind, one line per row (a header first for csv)."""
    import json

    out = []
    for i in range(24):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5))
        if kind == "csv":
            out.append(f"{text},{'pos' if i % 2 else 'neg'}".encode())
        elif kind == "json":
            out.append(json.dumps({"text": text, "label": i % 2}).encode())
        elif kind == "lm":
            out.append(json.dumps({"text": text}).encode())
        else:
            turns = [
                {"role": "user", "content": text},
                {"role": "assistant", "content": WORDS[i % len(WORDS)]},
            ]
            out.append(json.dumps({"messages": turns}).encode())
    return [b"text,label", *out] if kind == "csv" else out


WRONG_TYPE = {  # one row whose value has a type the kind does not read
    "csv": b'"a, b",[1,2]',  # a label that looks like a list: a string, so a third class (valid)
    "json": b'{"text": ["a", "b"], "label": 1}',
    "lm": b'{"text": {"nested": "doc"}}',
    "chat": b'{"messages": "hi there"}',
}
MUTATIONS = {
    "valid": lambda rows, kind: rows,
    "torn_last_line": lambda rows, kind: [*rows[:-1], rows[-1][: len(rows[-1]) // 2]],
    "broken_middle_line": lambda rows, kind: [*rows[:5], rows[5][:-3] + b",,", *rows[6:]],
    "latin1": lambda rows, kind: [
        *rows[:3],
        rows[3].replace(b"cat", "caf\u00e9".encode("latin-1")),
        *rows[4:],
    ],
    "utf16": lambda rows, kind: [b"\n".join(rows).decode().encode("utf-16")],
    "empty": lambda rows, kind: [],
    "blank_lines": lambda rows, kind: [b"", b"   ", b""],
    "not_an_object": lambda rows, kind: [*rows[:2], b"[1, 2, 3]", *rows[2:]],
    "wrong_type": lambda rows, kind: [*rows[:4], WRONG_TYPE[kind], *rows[4:]],
    "binary": lambda rows, kind: [bytes(range(256))],
}
KIND_ARGS = {
    "csv": (".csv", ["task=csv", "model=bert-tiny"]),
    "json": (".jsonl", ["task=json", "model=bert-tiny"]),
    "lm": (".jsonl", ["task=lm", "model=gpt2-tiny"]),
    "chat": (".jsonl", ["task=chat", "model=gpt2-tiny"]),
}
DATA_BASE = [
    "trainer.max_steps=1",
    "trainer.progress=none",
    "task.max_seq_len=16",
    "batch.size=4",
    "batch.ubatch_size=2",
    "task.max_eval_samples=4",
    "logger=none",
    "trainer.eval_every=0",
]
DATA_CASES = [(kind, m) for kind in KIND_ARGS for m in MUTATIONS]


def data_case(tmp_path, kind: str, mutation: str) -> list[str]:
    suffix, args = KIND_ARGS[kind]
    rows = MUTATIONS[mutation](_valid_rows(kind), kind)
    path = tmp_path / f"{mutation}{suffix}"
    path.write_bytes(b"\n".join(rows) + (b"\n" if rows else b""))
    extra = []
    if kind == "chat":
        (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
        extra.append(f"task.chat_template={tmp_path / 't.jinja'}")
    if kind == "lm":
        extra.append("task.dev_fraction=0.25")
    return [*DATA_BASE, *args, *extra, f"task.files=[{path}]"]


def check_data_case(tmp_path, kind: str, mutation: str) -> None:
    overrides = data_case(tmp_path, kind, mutation)
    problem = check_outcome(overrides, tmp_path / "run")
    assert problem is None, f"{kind}/{mutation}: {problem}"


FAST_DATA = [c for i, c in enumerate(DATA_CASES) if c[1] != "valid" and i % 2 == 0] + [("json", "valid")]


@pytest.mark.parametrize(("kind", "mutation"), FAST_DATA)
def test_fuzz_data_files_start_or_are_refused_in_one_line(tmp_path, kind: str, mutation: str) -> None:
    check_data_case(tmp_path, kind, mutation)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "mutation"), [c for c in DATA_CASES if c not in FAST_DATA])
def test_fuzz_data_files_the_other_cases(tmp_path, kind: str, mutation: str) -> None:
    check_data_case(tmp_path, kind, mutation)
