"""The parallel machinery: process groups, the plan and its mesh, the token layout, collectives (also on copy
engines), the one attention split, tensor-parallel weights, and the generic path for a declared split plan."""
