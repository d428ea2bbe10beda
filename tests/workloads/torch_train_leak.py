"""The seed's training-loop bug on torch CPU: `loss_history.append(loss)` keeps each step's
autograd graph, and `retain_graph=True` keeps the graph's saved activations with it.

    torch_train_leak.py SECONDS

Prints "ready", waits for a line on stdin, trains for SECONDS, prints "done", waits again.
"""

import sys
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loss_history = []


def train_step(x, y):
    opt.zero_grad()
    out = model(x)  # L:forward
    loss = F.mse_loss(out, y)
    loss.backward(retain_graph=True)
    opt.step()
    return loss


def train(seconds):
    # steps on a fixed schedule (one per 60 ms, catching up after a stall): the leak grows at one
    # pace in wall time even when the machine is slow for a while
    start = time.monotonic()
    steps = 0
    while time.monotonic() < start + seconds:
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        loss = train_step(x, y)  # L:step
        loss_history.append(loss)  # the bug: loss.item() would keep a float
        steps += 1
        time.sleep(max(0.0, start + steps * 0.06 - time.monotonic()))


print("ready", flush=True)
sys.stdin.readline()
train(float(sys.argv[1]))
print("done", flush=True)
sys.stdin.readline()
