"""Graph helpers the grammar readers share."""

from __future__ import annotations

from typing import Hashable, TypeVar

__all__ = ["strongly_connected"]

Key = TypeVar("Key", bound=Hashable)


def strongly_connected(graph: dict[Key, list[Key]]) -> list[list[Key]]:
    """The strongly connected components of ``graph`` (each node's list: the nodes it
    refers to), each after every component it reaches: a grammar's rules callees first
    (Tarjan's algorithm, iterative: a chain of thousands of rules is no deep recursion)."""
    index: dict[Key, int] = {}
    low: dict[Key, int] = {}
    stack: list[Key] = []
    on_stack: set[Key] = set()
    out: list[list[Key]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            name, k = work.pop()
            if k == 0:
                index[name] = low[name] = len(index)
                stack.append(name)
                on_stack.add(name)
            edges = graph[name]
            while k < len(edges) and edges[k] in index:
                if edges[k] in on_stack:
                    low[name] = min(low[name], index[edges[k]])
                k += 1
            if k < len(edges):  # (descend into an unvisited rule; come back after it)
                work.append((name, k + 1))
                work.append((edges[k], 0))
                continue
            if low[name] == index[name]:
                members = []
                while True:
                    other = stack.pop()
                    on_stack.discard(other)
                    members.append(other)
                    if other == name:
                        break
                out.append(members)
            if work:  # (the caller takes the lowest link of the rule it descended into)
                parent = work[-1][0]
                low[parent] = min(low[parent], low[name])
    return out
