"""Your own categories (issue #38 §3): rules on allocation stacks, tried before the built-in ones.

The expected bytes are computed here from the raw snapshot (the pickle's blocks and trace
entries with their frames, read with ``pickle``), not from snaplab's frames or categories: a rule
on GPT-2's model file labels exactly the blocks one of whose frames is in that file."""

from __future__ import annotations

import fnmatch
import json
import lzma
import pickle
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api, cli
from snapshot_lab.errors import EXIT_USAGE, ParameterError
from snapshot_lab.metrics.categories import CATEGORIES, categorize
from snapshot_lab.plots.palette import CATEGORY_COLORS, USER_CATEGORY_COLORS

from .conftest import sample_path

GPT2 = sample_path("fit_gpt2_b32_oom_python")
GPT2_CKPT = sample_path("fit_gpt2_b128_ckpt_oom_python")
MODEL_FILE = "gpt2=file:*modeling_gpt2.py"
ATTENTION = "attention=func:*attention*"
runner = CliRunner()


@pytest.fixture(scope="session")
def raw() -> dict[str, Any]:
    with lzma.open(GPT2) as f:
        return pickle.load(f)  # a sample of this repository: trusted


def _in_file(frame: dict[str, Any]) -> bool:
    return fnmatch.fnmatchcase(frame["filename"].replace("\\", "/"), "*modeling_gpt2.py")


def _attention(frame: dict[str, Any]) -> bool:
    return fnmatch.fnmatchcase(frame["name"], "*attention*")


def _live_blocks(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for seg in raw["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]


def _bytes(blocks: list[dict[str, Any]], key: str = "size") -> int:
    return sum(int(b[key]) for b in blocks)


def _stats(*rules: str, categories_file: Path | None = None) -> dict[str, Any]:
    return api.stats(GPT2, category=list(rules), categories_file=categories_file).to_dict()


# --------------------------------------------------------------------------- what a rule labels


def test_a_rule_on_the_model_file_gets_exactly_the_blocks_whose_stacks_are_in_it(raw):
    live = _live_blocks(raw)
    mine = [b for b in live if any(_in_file(f) for f in b.get("frames", []))]
    assert mine and len(mine) < len(live)
    builtin, custom = _stats(), _stats(MODEL_FILE)
    assert custom["categories"]["gpt2"] == _bytes(mine)
    assert custom["categories_requested"]["gpt2"] == _bytes(mine, "requested_size")
    # the vocabulary: the built-in categories in their order, then the user's
    assert list(custom["categories"]) == [*CATEGORIES, "gpt2"]
    assert list(builtin["categories"]) == list(CATEGORIES)
    # what moved came out of the built-in categories, and nothing else changed
    moved = {c: builtin["categories"][c] - custom["categories"][c] for c in CATEGORIES}
    assert all(v >= 0 for v in moved.values()) and sum(moved.values()) == _bytes(mine)
    assert sum(custom["categories"].values()) == raw_allocated(raw) == sum(builtin["categories"].values())
    assert custom["category_rules"] == [{"name": "gpt2", "kind": "file", "pattern": "*modeling_gpt2.py"}]
    assert "category_rules" not in builtin
    for key in ("torch_stats", "fragmentation", "oom"):
        assert custom[key] == builtin[key]


def raw_allocated(raw: dict[str, Any]) -> int:
    return _bytes(_live_blocks(raw))


def test_the_first_rule_that_matches_wins(raw):
    live = _live_blocks(raw)
    attention = [b for b in live if any(_attention(f) for f in b.get("frames", []))]
    model = [b for b in live if any(_in_file(f) for f in b.get("frames", []))]
    both = [b for b in attention if b in model]
    assert attention and both and len(model) > len(both)  # the two rules overlap, not wholly
    first = _stats(ATTENTION, MODEL_FILE)["categories"]
    assert (first["attention"], first["gpt2"]) == (_bytes(attention), _bytes(model) - _bytes(both))
    second = _stats(MODEL_FILE, ATTENTION)["categories"]
    assert (second["gpt2"], second["attention"]) == (_bytes(model), _bytes(attention) - _bytes(both))
    assert list(second)[-2:] == ["gpt2", "attention"]  # new names in the order of their first rule


def test_a_built_in_name_forces_that_category(raw):
    model = [b for b in _live_blocks(raw) if any(_in_file(f) for f in b.get("frames", []))]
    builtin = _stats()["categories"]
    forced = _stats("optimizer_state=file:*modeling_gpt2.py")["categories"]
    assert list(forced) == list(CATEGORIES)  # no new category
    assert builtin["optimizer_state"] == 0  # out of memory before the first step
    assert forced["optimizer_state"] == _bytes(model)


def test_each_kind_of_pattern(raw):
    live = _live_blocks(raw)

    def expected(hit: Any) -> int:
        return _bytes([b for b in live if any(hit(f) for f in b.get("frames", []))])

    def text(f: dict[str, Any]) -> str:
        return f"{f['filename']}:{f['line']}:{f['name']}"

    cases = {
        "x=func:forward": lambda f: f["name"] == "forward",
        "x=frame:*modeling_gpt2.py:57?:forward": lambda f: _in_file(f) and 570 <= f["line"] < 580,
        r"x=re:modeling_gpt2\.py:2\d\d:forward$": lambda f: _in_file(f) and 200 <= f["line"] < 300,
    }
    seen = set()
    for rule, hit in cases.items():
        got = _stats(rule)["categories"]["x"]
        assert got == expected(hit) > 0, rule
        seen.add(got)
    assert len(seen) == len(cases)  # three different answers: each kind read what it says
    # a glob is matched whole: the function name 'forward' is not '*forward*'
    assert _stats("x=func:orward")["categories"].get("x", 0) == 0


def test_the_analyses_keep_the_built_in_categories():
    frames = api.load_frames(GPT2)
    before = categorize(frames).block_category.copy()
    rules = api.rules_of([MODEL_FILE])
    assert rules is not None
    relabelled = categorize(frames, rules)
    assert (relabelled.block_category == "gpt2").any()
    assert categorize(frames).block_category.equals(before)  # the built-in result is another object
    assert relabelled.names == (*CATEGORIES, "gpt2")


# --------------------------------------------------------------------------- where they are shown


def test_the_perfetto_export_counts_and_names_them(raw, tmp_path):
    out = tmp_path / "t.json"
    api.export(GPT2, format="perfetto", output=out, category=[MODEL_FILE])
    trace = json.loads(out.read_text())
    counters = [e for e in trace["traceEvents"] if e.get("name") == "category" and e.get("ph") == "C"]
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "allocation" and e.get("ph") in ("b", "X", "B")]
    # from the raw trace: the allocations one of whose frames is in the file, and what of them is
    # alive at the last event
    entries = raw["device_traces"][0]
    live: dict[int, int] = {}
    made = 0
    for e in entries:
        if e["action"] == "alloc" and any(_in_file(f) for f in e.get("frames", [])):
            live[e["addr"]] = int(e["size"])
            made += 1
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    assert counters[-1]["args"]["gpt2"] == sum(live.values())
    assert sum(1 for s in slices if s["name"] == "gpt2") == made
    assert trace["otherData"]["category_rules"] == [{"name": "gpt2", "kind": "file", "pattern": "*modeling_gpt2.py"}]


def test_the_report_shows_them_and_escapes_the_rule(tmp_path):
    hostile = "mine=re:modeling_gpt2|<script>alert(1)</script>"
    path = api.report(GPT2, output=tmp_path / "r.html", category=[hostile, "other=func:_apply"])
    html = Path(path).read_text()
    assert ">mine<" in html
    assert "your category, labelled by your rule mine=re:modeling_gpt2|&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html
    assert "351.46 MiB by your rule other=func:_apply" in html  # a built-in category forced by a rule
    plain = api.report(GPT2, output=tmp_path / "plain.html")
    assert "your rule" not in Path(plain).read_text()


def test_diff_compares_them(raw):
    result = api.diff(GPT2, GPT2_CKPT, category=[MODEL_FILE]).to_dict()
    rows = {row["name"]: row for row in result["categories"]}
    first, second = _stats(MODEL_FILE), api.stats(GPT2_CKPT, category=[MODEL_FILE]).to_dict()
    assert rows["gpt2"]["before"] == first["categories"]["gpt2"]
    assert rows["gpt2"]["after"] == second["categories"]["gpt2"] > 0
    assert "gpt2" not in {row["name"] for row in api.diff(GPT2, GPT2_CKPT).to_dict()["categories"]}


def test_stats_text_lists_them():
    r = runner.invoke(cli.app, ["stats", str(GPT2), "-q", "--category", MODEL_FILE])
    assert r.exit_code == 0, r.stderr
    assert f"your rules first (the first that matches an allocation's stack wins): {MODEL_FILE}" in r.stdout
    gpt2 = _stats(MODEL_FILE)["categories"]["gpt2"]
    line = next(line for line in r.stdout.splitlines() if line.startswith("gpt2 "))
    from snapshot_lab.units import format_bytes

    assert format_bytes(gpt2) in line
    plain = runner.invoke(cli.app, ["stats", str(GPT2), "-q"])
    assert "your rules first" not in plain.stdout


def test_a_rules_file_comes_after_the_options(tmp_path, raw):
    toml = tmp_path / "rules.toml"
    toml.write_text('gpt2 = "file:*modeling_gpt2.py"\nattention = ["func:*attention*"]\n')
    as_json = tmp_path / "rules.json"
    as_json.write_text(json.dumps({"gpt2": "file:*modeling_gpt2.py", "attention": ["func:*attention*"]}))
    by_options = _stats(ATTENTION, MODEL_FILE)["categories"]
    for path in (toml, as_json):
        from_file = _stats(ATTENTION, categories_file=path)["categories"]
        assert from_file == by_options  # the option's rule first, then the file's (its own repeated: no-op)
        assert _stats(categories_file=path)["categories"] == _stats(MODEL_FILE, ATTENTION)["categories"]


def test_user_categories_have_colours_of_their_own():
    import hashlib

    # chosen by the name, so the same in every run, figure and page
    assert CATEGORY_COLORS["gpt2"] == USER_CATEGORY_COLORS[hashlib.sha256(b"gpt2").digest()[0] % 8]
    assert CATEGORY_COLORS["gpt2"] not in dict.values(CATEGORY_COLORS)  # no built-in category's colour
    assert CATEGORY_COLORS["activation"] == "#e15759"
    assert CATEGORY_COLORS.get("gpt2", "#bab0ac") == "#bab0ac"  # get keeps dict's meaning
    assert set(CATEGORY_COLORS) == set(CATEGORIES)


# --------------------------------------------------------------------------- bad rules


BAD = {
    "invalid_regex": (["--category", "x=re:("], "--category: rule for 'x': not a regular expression"),
    "empty_name": (["--category", "=func:forward"], "--category: a category needs a name"),
    "no_equals": (["--category", "func:forward"], "--category: 'func:forward' is not NAME=KIND:PATTERN"),
    "unknown_kind": (["--category", "x=forward"], "--category: rule for 'x': the pattern starts with its kind"),
    "empty_pattern": (["--category", "x=func:"], "--category: rule for 'x': the pattern must be 1 to 500"),
    "long_name": (["--category", "a" * 65 + "=func:x"], "--category: category name 'aaaa"),
    "hostile_name": (["--category", "<b>x</b>=func:x"], "--category: category name '<b>x</b>': letters, digits"),
    "missing_file": (["--categories-file", "/nonexistent/rules.toml"], "--categories-file /nonexistent/rules.toml"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_rule_is_one_line_and_a_usage_error(case):
    args, start = BAD[case]
    r = runner.invoke(cli.app, ["stats", str(GPT2), "-q", *args])
    assert r.exit_code == EXIT_USAGE == 2
    assert r.stderr.startswith(f"snaplab: error: {start}"), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("bad.toml", "gpt2 = [1, 2]\n", "the patterns of 'gpt2' must be strings"),
        ("bad.toml", "gpt2 = \n", "Invalid value (at line 1, column 8)"),
        ("bad.json", "[1, 2]", "expected a table of NAME"),
        ("bad.json", "{nope", "Expecting property name enclosed in double quotes"),
        ("bad.json", '{"a=b": "func:x"}', "category name 'a=b': letters, digits"),
    ],
)
def test_a_bad_rules_file_is_one_line_and_a_usage_error(tmp_path, name, content, says):
    path = tmp_path / name
    path.write_text(content)
    r = runner.invoke(cli.app, ["stats", str(GPT2), "-q", "--categories-file", str(path)])
    assert r.exit_code == 2
    assert r.stderr.startswith(f"snaplab: error: --categories-file {path}: {says}"), r.stderr
    assert r.stderr.count("\n") == 1


def test_the_api_names_its_parameters():
    with pytest.raises(ParameterError, match=r"^category: rule for 'x': not a regular expression") as exc:
        api.stats(GPT2, category=["x=re:("])
    assert exc.value.parameter == "category"
    with pytest.raises(ParameterError, match=r"^category needs format='perfetto'"):
        api.export(GPT2, output="unused", format="csv", category=[MODEL_FILE])
    assert api.rules_of() is None and api.rules_of([], None) is None


@pytest.mark.parametrize("command", ["stats", "report", "diff", "export"])
def test_the_options_are_defined_once_and_shared(command):
    import inspect

    params = inspect.signature(getattr(cli, command)).parameters
    assert str(params["category"].annotation) == "CategoryOpt"
    assert str(params["categories_file"].annotation) == "CategoriesFileOpt"


def test_the_mcp_server_never_quotes_a_rules_file():
    from snapshot_lab import mcp_server

    exc = ParameterError("categories_file", "{categories_file} {path}: {problem}", path="x.json", problem="'secret'")
    told = mcp_server.client_message(exc)
    assert "secret" not in told and told.startswith("categories_file: not a rules file")
    bad_rule = ParameterError("category", "{category}: {problem}", problem="rule for 'x': not a regular expression")
    assert mcp_server.client_message(bad_rule) == "category: rule for 'x': not a regular expression"
