"""The tiny demo model's world: procedurally generated chat tasks, their reply check and BPE tokenizer
(`tasks`), and evaluation on held-out problems (`evaluation`). Not part of a checkpoint's code."""
