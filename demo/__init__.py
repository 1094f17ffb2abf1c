"""The tiny demo model's world: procedurally generated chat tasks, their reply check and BPE tokenizer (`tasks`),
evaluation on held-out problems (`evaluation`) and the benchmark against the autoregressive base (`bench`). Not part
of a checkpoint's code."""
