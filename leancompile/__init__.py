"""leancompile: removes the redundant backbone forward of GRPO post-training for flow transformers."""
