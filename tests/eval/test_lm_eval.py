"""The lm_eval adapter (`--model psr`) against lm_eval's own `--model hf` on local tasks."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model, write_checkpoint

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm_eval's hf model imports it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import psr.eval.lm_eval_adapter  # noqa: E402, F401  (registers "psr")
from psr.eval.lm_eval_adapter import PSRLM  # noqa: E402

TASKS = ["psr_t_newline", "psr_t_space", "psr_t_rolling", "psr_t_gen"]

NEWLINE_ROWS = [  # context "question: ...\n", target_delimiter "": the "\n" joins the answer
    {"q": "what is the sun", "choices": ["answer: a star", "answer: the sea"], "label": 0},
    {"q": "where do fish swim", "choices": ["answer: in water", "answer: on hills"], "label": 0},
    {"q": "what is day\n", "choices": ["answer: light", "answer: dark, cold night"], "label": 1},
]
SPACE_ROWS = [  # context "... " ending in a space, target_delimiter ""
    {"ctx": "now is the winter of our", "choices": ["discontent", "bosom"], "label": 0},
    {"ctx": "in the deep bosom of the", "choices": ["ocean", "winter", "sun"], "label": 0},
    {"ctx": "made glorious summer by this", "choices": ["sun", "house"], "label": 1},
]
DOCS = [  # the first two span several 128-token windows
    "now is the winter of our discontent made glorious summer by this sun of york, "
    "and all the clouds that lowered upon our house in the deep bosom of the ocean buried. "
    "now are our brows bound with victorious wreaths, our bruised arms hung up for monuments.",
    "to be, or not to be: that is the question. whether tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles "
    "and by opposing end them. to die, to sleep, no more. and by a sleep to say we end.",
    "a short one.",
]
GEN_ROWS = [{"ctx": "now is the winter of", "t": "x"}, {"ctx": "to be, or not", "t": "x"}]


def write_bpe_tokenizer(path: Path) -> None:
    """Characters plus merges across spaces and newlines, so that where the context ends
    changes the tokens (as in real BPE vocabularies); an EOS for the prefix token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = " \n.,:?" + string.ascii_lowercase
    vocab = {"<unk>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    pairs = [(" ", c) for c in "tsobwdhamfy"] + [("\n", "a"), ("\n", "\n"), ("e", " ")]
    pairs += [("s", " "), ("d", " "), ("t", "h"), ("th", "e"), (" ", "the")]
    for a, b in pairs:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) <= 64  # the tiny model's vocabulary
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)


def _task(name: str, data: Path, rows: list[dict], body: str) -> str:
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return (
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, TaskManager]:
    root = tmp_path_factory.mktemp("lmeval")
    ckpt = write_checkpoint(tiny_model("olmoe"), root / "olmoe")
    write_bpe_tokenizer(ckpt)
    mc = "output_type: multiple_choice\ntarget_delimiter: ''\ndoc_to_target: '{{label}}'\n"
    mc += "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    tasks = root / "tasks"
    tasks.mkdir()
    yamls = {
        "psr_t_newline": _task(
            "psr_t_newline", root / "nl.jsonl", NEWLINE_ROWS, mc + 'doc_to_text: "{{q}}\\n"\n'
        ),
        "psr_t_space": _task(
            "psr_t_space", root / "sp.jsonl", SPACE_ROWS, mc + "doc_to_text: '{{ctx}} '\n"
        ),
        "psr_t_rolling": _task(
            "psr_t_rolling",
            root / "docs.jsonl",
            [{"text": d} for d in DOCS],
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
            "  - metric: bits_per_byte\n",
        ),
        "psr_t_gen": _task(
            "psr_t_gen",
            root / "gen.jsonl",
            GEN_ROWS,
            "output_type: generate_until\ndoc_to_text: '{{ctx}}'\ndoc_to_target: '{{t}}'\n"
            'generation_kwargs:\n  until: [".", "\\n"]\n  max_gen_toks: 6\n'
            "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
        ),
    }
    for name, text in yamls.items():
        (tasks / f"{name}.yaml").write_text(text)
    return ckpt, TaskManager(include_path=str(tasks), include_defaults=False)  # fast: ours only


def _evaluate(model, model_args: str, tm: TaskManager, tasks: list[str]) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=tm,
        device="cpu",
        batch_size=1,
        bootstrap_iters=0,
        log_samples=True,
    )


def _numbers(resp) -> list[float]:
    """Every number in a response (log-likelihoods; is-greedy flags as 0/1)."""
    if isinstance(resp, (list, tuple)):
        return [x for r in resp for x in _numbers(r)]
    return [float(resp)]


def test_psr_exact_matches_lm_eval_hf(setup, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt, tm = setup
    hf = _evaluate("hf", f"pretrained={ckpt},dtype=float32", tm, TASKS)
    ps = _evaluate("psr", f"pretrained={ckpt},policy=exact,residency=0.5,dtype=float32", tm, TASKS)
    worst = {}
    for task in TASKS:
        a = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(ps["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in a] == [s["arguments"] for s in b]
        if task == "psr_t_gen":
            assert [s["filtered_resps"] for s in a] == [s["filtered_resps"] for s in b]
            assert all(isinstance(s["filtered_resps"][0], str) for s in b)
            continue
        for key in ("resps", "filtered_resps"):
            x = [v for s in a for v in _numbers(s[key])]
            y = [v for s in b for v in _numbers(s[key])]
            assert len(x) == len(y) > 0
            assert all(math.isfinite(v) for v in y)
            worst[task] = max(abs(u - v) for u, v in zip(x, y, strict=True))
            assert worst[task] < 1e-4, (task, key, x, y)
    for task in ("psr_t_newline", "psr_t_space"):
        for metric in ("acc,none", "acc_norm,none"):
            assert hf["results"][task][metric] == ps["results"][task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = ps["results"]["psr_t_rolling"][metric], hf["results"]["psr_t_rolling"][metric]
        assert got == pytest.approx(want, rel=1e-5), metric
    print("max |d loglik| per task:", worst)


def test_requests_are_split_as_hflm_splits_them(setup) -> None:
    """Whitespace moves from context to continuation; an empty context is the EOS."""
    ckpt, _ = setup
    lm = PSRLM(pretrained=str(ckpt), policy="exact", dtype="float32")
    assert lm.prefix_token_id == lm.eot_token_id == 1
    assert lm.max_length == 128 and lm.model.hf.dtype == torch.float32
    ctx, cont = lm._encode_pair("made glorious summer by this ", "sun")
    assert lm.tok_decode(cont) == " sun" and ctx == lm.tok_encode("made glorious summer by this")
    assert ctx + cont == lm.tok_encode("made glorious summer by this sun")
    reqs = [
        Instance("loglikelihood", {}, ("", "now is the winter"), 0),
        Instance("loglikelihood", {}, ("to be\n\n", "or not"), 0),
    ]
    (empty, _), (nl, _) = lm.loglikelihood(reqs, disable_tqdm=True)
    # The runtime's decode-step scores, summed by hand over the same split.
    for ll, (c, x) in (
        (empty, ([1], lm.tok_encode("now is the winter"))),
        (nl, lm._encode_pair("to be\n\n", "or not")),
    ):
        ids = c + x
        logits = lm.model.hf(torch.tensor([ids])).logits[0].float()
        want = sum(
            torch.log_softmax(logits[i - 1], -1)[ids[i]].item() for i in range(len(c), len(ids))
        )
        assert ll == pytest.approx(want, abs=1e-4)


def test_psr_policy_scores_continuations_as_decode_steps(setup, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt, tm = setup
    lm = PSRLM(pretrained=str(ckpt), policy="psr", residency=0.5, lam=0.5, n=1, batch_size=4)
    out = _evaluate(lm, "", tm, ["psr_t_space", "psr_t_gen"])
    assert 0.0 <= out["results"]["psr_t_space"]["acc,none"] <= 1.0
    lls = [v for s in out["samples"]["psr_t_space"] for v in _numbers(s["resps"])]
    assert all(math.isfinite(v) for v in lls)
    # Generation honours the stop strings and max_gen_toks.
    for s in out["samples"]["psr_t_gen"]:
        text = s["filtered_resps"][0]
        assert "." not in text and "\n" not in text
        assert len(lm.tok_encode(text)) <= 6
    # The prefill's last position predicts the first continuation token; each later one
    # comes from a decode step under the policy.
    _, cont = lm._encode_pair("now is the winter of our ", "discontent")
    lm.model.reset_stats()
    lm.loglikelihood(
        [Instance("loglikelihood", {}, ("now is the winter of our ", "discontent"), 0)]
    )
    assert lm.model.stats["tokens"] == len(cont) - 1 > 0


# Families with their own block, router or expert kind: lm_eval's `--model psr` equals its
# `--model hf` on the same checkpoint (the adapter is family-agnostic; this checks it is).
ROUTER_KIND_FAMILIES = ["gpt_oss", "llama4_text", "phimoe"]  # own blocks and expert kinds


@pytest.mark.parametrize("family", ROUTER_KIND_FAMILIES)
def test_psr_matches_lm_eval_hf_per_router_kind(setup, tmp_path, monkeypatch, family) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, tm = setup
    ckpt = write_checkpoint(tiny_model(family), tmp_path / family)
    write_bpe_tokenizer(ckpt)
    task = ["psr_t_newline"]
    hf = _evaluate("hf", f"pretrained={ckpt},dtype=float32", tm, task)
    ps = _evaluate("psr", f"pretrained={ckpt},policy=exact,residency=0.5,dtype=float32", tm, task)
    a = sorted(hf["samples"][task[0]], key=lambda s: s["doc_id"])
    b = sorted(ps["samples"][task[0]], key=lambda s: s["doc_id"])
    x = [v for s in a for v in _numbers(s["resps"])]
    y = [v for s in b for v in _numbers(s["resps"])]
    assert len(x) == len(y) > 0
    assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < 1e-4
