"""Query generation: app page graphs (networkx), path sampling, instruction synthesis."""
