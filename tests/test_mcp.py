"""``snaplab mcp``: the Model Context Protocol server, driven by the SDK's own client over stdio
(``python -m snapshot_lab mcp`` in a subprocess), answering with torch's own numbers."""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api, mcp_server
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_USAGE

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
