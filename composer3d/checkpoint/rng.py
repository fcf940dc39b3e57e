"""Each rank's random-number generator states, as JSON (restored when a resume keeps the world
size)."""

from __future__ import annotations

import base64

import torch


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict:
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type != "cpu":
        state[device.type] = _encode(torch.get_device_module(device.type).get_rng_state())
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device.type).set_rng_state(_decode(state[device.type]))
