"""The rollout inspector (``relayrl inspect RUN_DIR...``): a local web page over a run's saved rollouts
(token by token, coloured by logprob, advantage, generator-trainer gap, entropy or weight version)
and its metrics curves; ``relayrl.inspector.server`` serves or exports it."""
