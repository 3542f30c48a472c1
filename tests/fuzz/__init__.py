"""Coverage-guided fuzzing of every snaplab command (issue #13); see benchmarks/FUZZING.md."""
