"""Integrations with other tools: lm-evaluation-harness (`batchgen.integrations.lm_eval`)."""
