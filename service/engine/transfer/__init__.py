"""Weights a trainer pushes over a process group, in SGLang's protocol: joining its group exactly as
SGLang's servers do (group.py), receiving a bucket's broadcasts (receive.py), holding what arrived
for a version until it is complete or committed (pending.py), and the engine's side of it all
(receiver.py). Names map onto served tensors by loading/names.py, as a checkpoint reload's do."""
