"""_amqp: internal package."""
