"""CodeGym's published reference trajectories replayed through sandbox workers."""
