"""What the model runner does besides running a step: the start-up warm-up that fixes every
kernel variant before the first request (`warmup`)."""
