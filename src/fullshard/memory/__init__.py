"""Memory: predict it before launch (:mod:`~fullshard.memory.planner`, ``fullshard plan``) and
measure it while running (:mod:`~fullshard.memory.tracker`)."""
