"""``snaplab mcp``: the Model Context Protocol server, driven by the SDK's own client over stdio
(``python -m snapshot_lab mcp`` in a subprocess), answering with torch's own numbers."""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api, mcp_server
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_USAGE, SnapshotFormatError, UsageError

from .conftest import ROOT, sample_path, sample_truth

TIMEOUT_S = 120  # the whole conversation, server start included; no network is used
TOOLS = {"stats", "findings", "fit", "whatif", "diff", "ranks"}
# what the tools leave out of the API: files written, other machines reached, progress on a terminal
NOT_A_TOOL_PARAMETER = {"output", "scheduler", "progress"}


def test_tools_take_the_apis_parameters_and_defaults():
    assert {tool.__name__ for tool in mcp_server.TOOLS} == TOOLS
    for tool in mcp_server.TOOLS:
        ours = {n: p.default for n, p in inspect.signature(tool).parameters.items()}
        theirs = {
            n: p.default
            for n, p in inspect.signature(getattr(api, tool.__name__)).parameters.items()
            if n not in NOT_A_TOOL_PARAMETER
        }
        assert ours == theirs, tool.__name__


def test_without_the_sdk_the_command_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp raises ImportError
    monkeypatch.setitem(sys.modules, "mcp.server", None)
    monkeypatch.setitem(sys.modules, "mcp.server.mcpserver", None)
    r = CliRunner().invoke(app, ["mcp"])
    assert r.exit_code == EXIT_USAGE
    assert r.stderr == f"snaplab: error: {mcp_server.INSTALL_HINT}\n"
    assert "pip install 'snapshot-lab[mcp]'" in r.stderr


async def _conversation() -> dict[str, Any]:
    import anyio
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=["-m", "snapshot_lab", "mcp"], cwd=str(ROOT))
    out: dict[str, Any] = {}
    with anyio.fail_after(TIMEOUT_S):
        async with Client(params, read_timeout_seconds=TIMEOUT_S) as client:
            out["tools"] = (await client.list_tools()).tools
            out["stats"] = await client.call_tool("stats", {"snapshot": str(sample_path("oom_fragmentation"))})
            out["missing"] = await client.call_tool("stats", {"snapshot": str(ROOT / "no-such-snapshot.pickle")})
            out["bad_option"] = await client.call_tool(
                "whatif", {"snapshot": str(sample_path("oom_fragmentation")), "settings": ["x"]}
            )
            with tempfile.TemporaryDirectory() as tmp:
                secret = Path(tmp) / "credentials.txt"
                secret.write_text(f"{SECRET}\n")
                out["secret"] = await client.call_tool("stats", {"snapshot": str(secret)})
                out["directory"] = await client.call_tool("stats", {"snapshot": tmp})
                out["diff_secret"] = await client.call_tool("diff", {"before": str(secret), "after": str(secret)})
    return out


@pytest.fixture(scope="module")
def conversation() -> dict[str, Any]:
    pytest.importorskip("mcp")
    import anyio

    return anyio.run(_conversation)


def test_the_client_lists_the_tools(conversation):
    tools = {tool.name: tool for tool in conversation["tools"]}
    assert set(tools) == TOOLS
    assert tools["stats"].input_schema["required"] == ["snapshot"]
    assert set(tools["fit"].input_schema["properties"]) == {
        "snapshot",
        "memory_limit",
        "recorded_batch",
        "batch_scale",
        "checkpointing",
        "bf16",
        "optimizer",
        "max_entries",
    }
    assert all(tool.description for tool in tools.values())


def test_stats_returns_torchs_numbers(conversation):
    result = conversation["stats"]
    assert not result.is_error
    answer = json.loads(result.content[0].text)
    torch = sample_truth("oom_fragmentation")["memory_stats"]["0"]
    # every counter stats gives (the .current ones of torch.cuda.memory_stats(), all pools: a
    # snapshot holds no history of its peaks besides its trace) equals torch's own
    assert {key: torch[key] for key in answer["torch_stats"]} == answer["torch_stats"]
    assert {"reserved_bytes.all.current", "allocated_bytes.all.current"} <= set(answer["torch_stats"])
    assert answer["oom"]["cause"] == "fragmentation"
    # the same JSON as `snaplab stats --json`
    assert result.content[0].text == api.json_text(api.stats(sample_path("oom_fragmentation")).to_dict())


def test_errors_are_tool_errors_of_one_line(conversation):
    for name, words in (("missing", "no such file"), ("bad_option", "settings: expected KEY:VALUE, got 'x'")):
        result = conversation[name]
        assert result.is_error, name
        text = result.content[0].text
        assert words in text and "\n" not in text and "Traceback" not in text


SECRET = "tok=hunter2"  # short enough that the loader's 8 quoted bytes hold most of it


def test_an_error_never_quotes_the_file(conversation, tmp_path):
    """The CLI's message quotes a non-snapshot file's first bytes; over MCP they would let a
    client read a few bytes of any file, so the tool error leaves them out."""
    for name in ("secret", "diff_secret"):
        result = conversation[name]
        assert result.is_error, name
        text = result.content[0].text
        assert "not a PyTorch memory snapshot" in text
        assert "tok=" not in text and "hunter" not in text and "starts with" not in text
    cli_message = CliRunner().invoke(app, ["stats", str(_write(tmp_path / "s.txt", SECRET))]).stderr
    assert "tok=hunt" in cli_message  # the command line's message stays as pinned


def test_a_path_that_is_not_a_regular_file_is_refused(conversation, tmp_path):
    result = conversation["directory"]
    assert result.is_error and "not a regular file" in result.content[0].text
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SnapshotFormatError, match="not a regular file"):
        mcp_server.require_regular_files([str(fifo)])  # refused before anything opens it (would block)


def test_client_message_cuts_quoted_text():
    error = SnapshotFormatError(
        "/f", "not a PyTorch memory snapshot: neither a pickle nor JSON; file starts with b'ab'"
    )
    assert mcp_server.client_message(error) == "/f: not a PyTorch memory snapshot: neither a pickle nor JSON"
    assert (
        mcp_server.client_message(SnapshotFormatError("/f", "invalid load key, 'x'.")) == "/f: invalid load key, '…'."
    )
    assert mcp_server.client_message(UsageError("bad option")) == UsageError("bad option").message()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
