"""Adapters that put tonp's model and engine inside the RL frameworks users run.

    from tonp_models.integrations.trl import TonpGRPOTrainer     # TRL's GRPOTrainer (docs/trl.md)

Each adapter lives in its own module and imports its framework only there, so importing this
package costs nothing. Imports point downward: adapters use the model, the engine, the server
client and the training helpers; nothing in tonp imports an adapter.
"""
