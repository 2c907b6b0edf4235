"""Many specdec engines behind one OpenAI endpoint: ``--data-parallel-size`` on one host
(``dp_server``), Ray Serve across hosts (``ray_app``), both routed by ``router``."""
