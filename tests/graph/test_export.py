"""A step graph for other tools: networkx (a declared dependency) and
Graphviz DOT, with phases, roles, shapes and source lines as attributes."""
from __future__ import annotations

import shutil
import subprocess

import networkx as nx
import pytest
import torch

import stepfx
from tests.steps import lm_step, tiny_gpt, token_batches


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"gradient_clipping": 1.0, "stepfx": {"activation_memory_budget": 0.0}})(lm_step)
    (batch,) = token_batches(1)[0]
    step(model, opt, batch)
    return step


def test_networkx_has_every_node_and_use_with_its_attributes(step):
    for name, graph in step.graphs.items():
        g = graph.to_networkx()
        nodes = list(graph.gm.graph.nodes)
        assert list(g.nodes) == [n.name for n in nodes], name
        uses = 0
        for n in nodes:
            found = []
            torch.fx.node.map_arg((n.args, n.kwargs), found.append)
            uses += len(found)
        assert g.number_of_edges() == uses, name
        order = {n.name: i for i, n in enumerate(nodes)}
        assert nx.is_directed_acyclic_graph(g) and all(order[a] < order[b] for a, b in g.edges()), name
    g = step.plan.graph.to_networkx()
    attrs = dict(g.nodes(data=True))
    param = next(a for a in attrs.values() if a.get("role") == "param")
    assert param["op"] == "placeholder" and param["target"].startswith("param ") and param["dtype"] == "float32"
    phases = {a.get("phase") for a in attrs.values() if a["op"] == "call_function"}
    assert phases == {"forward", "backward", "optimizer"}
    assert any(a.get("target") == "aten.mm" and a.get("shape") for a in attrs.values())
    assert any("source" in a and "steps.py" in a["source"] for a in attrs.values())  # the user's lines
    assert any(a.get("recomputed_from") for a in attrs.values())  # passes' annotations travel too


def test_dot_names_every_node_and_edge(step):
    graph = step.plan.graph
    text = graph.to_dot("lm_step")
    g = graph.to_networkx()
    assert text.startswith('digraph "lm_step" {') and text.rstrip().endswith("}")
    assert sum(1 for line in text.splitlines() if " -> " in line) == g.number_of_edges()
    for node in g.nodes:
        assert f'"{node}" [label="{node}\\n' in text
    assert 'fillcolor="#ffe5cc"' in text  # backward nodes coloured
    dot = shutil.which("dot")
    if dot is not None:  # Graphviz itself, where installed, reads it
        out = subprocess.run([dot, "-Tsvg"], input=text, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "<svg" in out.stdout, out.stderr
