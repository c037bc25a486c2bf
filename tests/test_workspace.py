"""Scratch buffers per (device, stream) (CPU: the bookkeeping, with the CUDA calls stubbed)."""

import torch

from mhc_cute import workspace


def test_workspaces_of_dropped_streams_are_bounded(monkeypatch):
    """An engine that makes a stream per request does not pin one workspace per stream forever: past
    ``MAX_WORKSPACES`` the oldest is dropped; a stream seen again soon keeps its own."""
    handles = iter(range(10_000))
    monkeypatch.setattr(workspace, "_workspaces", {})
    monkeypatch.setattr(workspace, "_current_stream_handle", lambda device: next(handles))
    monkeypatch.setattr(workspace, "Workspace", lambda device: object())
    monkeypatch.setattr(workspace, "_is_capturing", lambda: False)
    dev = torch.device("cuda", 0)
    for _ in range(3 * workspace.MAX_WORKSPACES):
        workspace.get_workspace(dev)
    assert len(workspace._workspaces) == workspace.MAX_WORKSPACES
    newest = list(workspace._workspaces)[-1]
    monkeypatch.setattr(workspace, "_current_stream_handle", lambda device: newest[1])
    assert workspace.get_workspace(dev) is workspace._workspaces[newest]
