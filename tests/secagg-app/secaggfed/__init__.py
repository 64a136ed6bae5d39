"""Test app of tests/test_secagg_deployment.py: DiLoCo under SecAgg+ with every array recorded."""
