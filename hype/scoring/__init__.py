"""Per-sample HYPE metrics (ε_i, ε_t, −d_L, cos θ, c_IN) and the stages that compute them."""
