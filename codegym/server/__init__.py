"""What every server of the project shares: its lifecycle, gRPC plumbing (health, reflection,
drain), access tokens and TLS, metrics and logs."""
