"""Cleanup passes: make the captured graph functional, minimal and plain.

They remove what capture leaves behind and computes nothing for the step
(in-place writes to graph inputs, profiler markers, aliases, outputs that
are their own inputs, dead nodes), undo what a library did only because
it saw tracing (causal masks, repeated K/V heads), and read symbolic sizes
off batch inputs. They run first; every later pass assumes their result.
"""
