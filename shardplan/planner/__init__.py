"""The planner: capture -> annotate -> plan -> rewrite, one module a stage."""
